"""The data path: Nanoset files, tokenizers, tokenization, sampling, blending, data stages.

Torch is imported only when a batch is collated, so tokenization workers stay light.
"""

from nanotron_train.data.corpus import prepare_default_corpus
from nanotron_train.data.errors import DataError
from nanotron_train.data.nanoset import Nanoset, NanosetMetadata
from nanotron_train.data.stages import DatasetSpec, StageSpec
from nanotron_train.data.tokenize import tokenize_to_nanoset
from nanotron_train.data.tokenizer import LoadedTokenizer, load_tokenizer, train_tokenizer
from nanotron_train.data.train_data import TrainData

__all__ = [
    "DataError",
    "DatasetSpec",
    "LoadedTokenizer",
    "Nanoset",
    "NanosetMetadata",
    "StageSpec",
    "TrainData",
    "load_tokenizer",
    "prepare_default_corpus",
    "tokenize_to_nanoset",
    "train_tokenizer",
]
