"""The model config's special token ids (bos, eos, pad) against the tokenizer's.

`model.model_config.{bos,eos,pad}_token_id` only describe the model (the data path ends every
document with the tokenizer's own EOS); they matter where the model leaves us: the Hugging Face
export writes them into config.json and generation_config.json, and generation stops at the
EOS. An id that is an ordinary token (id 1 is `'!'` in a byte-level BPE: Nanotron's default
bos_token_id) would make a model stop on punctuation, so export and generation replace an id
that is not one of the tokenizer's special tokens by the tokenizer's EOS (bos, eos) or none
(pad): `ids_for_export`, the one rule. Training goes on with one warning that says so
(`token_id_warning`): nothing that Nanotron trains is refused for it. null (or a key left out
of the YAML) means: the tokenizer's.
"""

from __future__ import annotations

from typing import Any

TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_tokens(tok: Any) -> dict[int, str]:
    """id -> text of the special tokens of a `LoadedTokenizer` (its added tokens marked special)."""
    added = tok.tokenizer.get_added_tokens_decoder()
    return {i: t.content for i, t in sorted(added.items()) if t.special}


def token_id_problem(token_id: int, tok: Any) -> str | None:
    """Why `token_id` cannot be a special token id of `tok`, or None when it is one."""
    specials = special_tokens(tok)
    if token_id in specials:
        return None
    listed = ", ".join(f"{text}={i}" for i, text in specials.items()) or "none"
    if not 0 <= token_id < tok.vocab_size:
        return (
            f"{token_id} is not in the tokenizer {tok.path} ({tok.vocab_size} tokens; its "
            f"special tokens: {listed})"
        )
    text = tok.tokenizer.id_to_token(token_id)
    return (
        f"{token_id} is {text!r} in the tokenizer {tok.path}, not one of its special tokens "
        f"({listed}); set it to one of them, or null for the tokenizer's"
    )


def token_id_problems(model_config: Any, tok: Any) -> list[tuple[str, str]]:
    """(key under model_config, problem) for each set id that is not a special token of `tok`."""
    out = []
    for key in TOKEN_ID_KEYS:
        value = getattr(model_config, key, None)
        if value is not None and (problem := token_id_problem(int(value), tok)) is not None:
            out.append((key, problem))
    return out


def ids_for_export(model_config: Any, tok: Any) -> tuple[dict[str, int | None], list[str]]:
    """The ids to write in a Hugging Face config: the config's where they are special tokens of
    `tok`, else the tokenizer's EOS (bos, eos) or none (pad); plus one note per replacement."""
    ids: dict[str, int | None] = {k: getattr(model_config, k, None) for k in TOKEN_ID_KEYS}
    notes = []
    for key in ("bos_token_id", "eos_token_id"):
        if ids[key] is None:
            ids[key] = tok.eos_token_id
    for key, problem in token_id_problems(model_config, tok):
        ids[key] = None if key == "pad_token_id" else tok.eos_token_id
        notes.append(
            f"note: model_config.{key}: {problem}; writing {ids[key]} instead "
            "(train with the id fixed to silence this)"
        )
    return ids, notes


def generation_eos(model_config: Any, tok: Any) -> int:
    """The id generation stops at (and pads with): the exported eos_token_id."""
    eos = ids_for_export(model_config, tok)[0]["eos_token_id"]
    return tok.eos_token_id if eos is None else int(eos)


def token_id_warning(model_config: Any, tok: Any) -> str | None:
    """One line for every set id that is not a special token of `tok`: the keys, what they are
    in the tokenizer, and what export and generation use instead; None when all are special."""
    problems = [key for key, _ in token_id_problems(model_config, tok)]
    if not problems:
        return None
    ids, _ = ids_for_export(model_config, tok)
    given = " and ".join(
        f"model.model_config.{k}={getattr(model_config, k)} ({_what(getattr(model_config, k), tok)})"
        for k in problems
    )
    used = ", ".join(f"{k}={_what_id(ids[k], tok)}" for k in problems)
    specials = ", ".join(f"{text}={i}" for i, text in special_tokens(tok).items()) or "none"
    verb = "is not a special token" if len(problems) == 1 else "are not special tokens"
    return (
        f"{given} {verb} of the tokenizer {tok.path} (its special tokens: {specials}): training "
        f"goes on, but export and generation use {used} instead; set "
        f"{'it to a special token' if len(problems) == 1 else 'them to special tokens'}, or "
        "null for the tokenizer's"
    )


def _what(token_id: int, tok: Any) -> str:
    if 0 <= int(token_id) < tok.vocab_size:
        return repr(tok.tokenizer.id_to_token(int(token_id)))
    return f"beyond its {tok.vocab_size} tokens"


def _what_id(token_id: int | None, tok: Any) -> str:
    return "none" if token_id is None else f"{token_id} ({tok.tokenizer.id_to_token(token_id)})"
