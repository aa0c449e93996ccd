"""Other formats: Hugging Face folders, Nanotron checkpoints, initial weights."""
