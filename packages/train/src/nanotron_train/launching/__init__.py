"""How the commands start their processes: the checkpoint commands' tp group, the quickstart's port owner."""
