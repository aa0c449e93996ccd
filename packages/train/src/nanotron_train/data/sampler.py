"""Per-dataset sample order: a seeded shuffle of the samples, reshuffled every epoch."""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger("nanotron_train.data")


class ShuffledSamples:
    """Maps the j-th sample drawn from one dataset to a sample id of that dataset.

    Epoch ``e = j // num_samples`` uses the permutation from ``default_rng((seed + e, index))``,
    ``index`` being the dataset's position in its stage, so two folders in one blend are not
    shuffled alike. The first draw of each new epoch is logged once.
    """

    def __init__(self, num_samples: int, seed: int, index: int, name: str, log: bool = True):
        self.num_samples = num_samples
        self.seed = seed
        self.index = index
        self.name = name
        self.log = log
        self._perms: dict[int, np.ndarray] = {}
        self._logged_epoch = 0

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) >= 2:  # a batch spans at most two epochs of one dataset
                self._perms.pop(min(self._perms))
            rng = np.random.default_rng((self.seed + epoch, self.index))
            perm = rng.permutation(self.num_samples)
            self._perms[epoch] = perm
        return perm

    def sample_ids(self, first: int, count: int) -> np.ndarray:
        """Sample ids of draws first .. first+count-1 (may cross an epoch boundary)."""
        out = []
        j, end = first, first + count
        while j < end:
            epoch, i = divmod(j, self.num_samples)
            take = min(end - j, self.num_samples - i)
            self._log_epoch(epoch)
            out.append(self._perm(epoch)[i : i + take])
            j += take
        if len(out) == 1:
            return out[0]
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def _log_epoch(self, epoch: int) -> None:
        if epoch > self._logged_epoch:
            self._logged_epoch = epoch
            if self.log:
                logger.info(
                    "data: %s ran out of samples after %d, starting epoch %d (reshuffled with seed %d)",
                    self.name,
                    epoch * self.num_samples,
                    epoch + 1,
                    self.seed + epoch,
                )
