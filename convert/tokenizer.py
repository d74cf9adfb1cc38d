"""Rebuild a Hugging Face tokenizer from the tokenizer stored in GGUF metadata.

A GGUF file has no ``tokenizer.json``; llama.cpp's converter stores the
vocabulary under ``tokenizer.ggml.*`` keys instead.  This module turns those
keys back into a ``tokenizers`` pipeline and saves it with
``transformers.PreTrainedTokenizerFast`` (``tokenizer.json`` +
``tokenizer_config.json`` + chat template), which ``mlx_lm.load`` and
``AutoTokenizer`` read unchanged.  It needs neither torch nor the network.

Two vocabulary kinds are handled:

``gpt2`` (byte-level BPE: SmolLM, Llama 3, ...)
    Tokens are already spelled in the byte-to-unicode alphabet and the merges
    are stored.  What the file does not store is the regular expression that
    splits text before BPE; it only names it (``tokenizer.ggml.pre``), so each
    supported name maps to its splitting rule below.

``llama`` (SentencePiece BPE: Gemma, Llama 2, Mistral v0.1, ...)
    Tokens carry scores and no merges.  Merges are recovered from the
    vocabulary: every way of cutting a token into two tokens is a merge, ranked
    by the merged token's priority (its score; for Gemma its position in the
    vocabulary, which is its merge order).  Byte fallback covers bytes that
    have no token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import ConversionError

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_SPM_SPACE = "\u2581"  # the SentencePiece word-boundary mark

# Text splitting before byte-level BPE, by the GGUF ``tokenizer.ggml.pre`` name.
#   "gpt2":   the GPT-2 rule (built into the ByteLevel pre-tokenizer)
#   "digits": every number character on its own, then the GPT-2 rule
#   "llama3": the Llama 3 rule (case-insensitive contractions, 1-3 digit groups)
#   "qwen2":  the Llama 3 rule with every digit on its own (Qwen 2 and 3)
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)
_SPLIT_PATTERNS = {
    "llama3": _LLAMA3_PATTERN,
    "qwen2": _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}"),
}
BPE_PRE_TOKENIZERS: dict[str, str] = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "smaug-bpe": "llama3",
    "falcon3": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
}
# vocabularies whose BPE ignores merges for a word that is already one token
_IGNORE_MERGES = {"llama3"}

# architectures whose SentencePiece vocabulary is ranked by position, not score
_POSITION_RANKED = {"gemma", "gemma2", "gemma3"}


def _required(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise ConversionError(f"GGUF metadata has no {key!r}; cannot rebuild the tokenizer")
    return meta[key]


def _token_name(tokens: Sequence[str], meta: Mapping[str, Any], key: str) -> str | None:
    index = meta.get(f"tokenizer.ggml.{key}")
    if index is None:
        return None
    if not 0 <= int(index) < len(tokens):
        raise ConversionError(f"GGUF tokenizer.ggml.{key}={index} is outside the vocabulary")
    return tokens[int(index)]


def _byte_level(meta: Mapping[str, Any], tokens: list[str]) -> tuple[Any, bool]:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    rule = BPE_PRE_TOKENIZERS.get(pre)
    if rule is None:
        raise ConversionError(
            f"GGUF byte-level tokenizer with pre-tokenizer {pre!r} is not supported; "
            f"supported: {', '.join(sorted(BPE_PRE_TOKENIZERS))}"
        )
    merges_raw = _required(meta, "tokenizer.ggml.merges")
    merges: list[tuple[str, str]] = []
    for line in merges_raw:
        left, sep, right = str(line).partition(" ")
        if not sep:
            raise ConversionError(f"GGUF merge {line!r} is not two tokens separated by a space")
        merges.append((left, right))
    vocab = {token: index for index, token in enumerate(tokens)}
    model = models.BPE(
        vocab=vocab,
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=rule in _IGNORE_MERGES,
    )
    tok = Tokenizer(model)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if rule == "gpt2":
        tok.pre_tokenizer = byte_level
    elif rule == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PATTERNS[rule]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok, False


def spm_merges(tokens: Sequence[str], ranks: Sequence[float], eligible: Sequence[bool]) -> list:
    """All two-token cuts of every eligible token, best rank (lowest) first.

    A merge ``(left, right)`` exists for a token ``t`` when ``t == left + right``
    and both halves are tokens.  Its priority is the rank of ``t``; cuts of the
    same token are ordered by the ids of their halves, so the result is
    deterministic.
    """
    vocab = {token: index for index, token in enumerate(tokens)}
    keyed: list[tuple[float, int, int, str, str]] = []
    for index, token in enumerate(tokens):
        if not eligible[index] or len(token) < 2:
            continue
        rank = ranks[index]
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_id = vocab.get(left)
            if left_id is None:
                continue
            right_id = vocab.get(right)
            if right_id is None:
                continue
            keyed.append((rank, left_id, right_id, left, right))
    keyed.sort(key=lambda item: (item[0], item[1], item[2]))
    return [(left, right) for _, _, _, left, right in keyed]


def _sentencepiece(
    meta: Mapping[str, Any], tokens: list[str], types: list[int], architecture: str
) -> tuple[Any, bool]:
    from tokenizers import Tokenizer, decoders, models, normalizers

    position_ranked = architecture in _POSITION_RANKED
    if position_ranked:
        # Gemma stores its tokens made of several spaces with real spaces; the
        # model sees them after spaces became the word-boundary mark.
        tokens = [_SPM_SPACE * len(t) if t and " " in t and not t.strip() else t for t in tokens]
        ranks: list[float] = [float(i) for i in range(len(tokens))]
    else:
        scores = _required(meta, "tokenizer.ggml.scores")
        if len(scores) != len(tokens):
            raise ConversionError("GGUF tokenizer scores and tokens have different lengths")
        ranks = [-float(s) for s in scores]
    # SentencePiece never produces control, unknown, unused or byte tokens by
    # merging, so they are no merge targets.
    eligible = [t in (NORMAL, USER_DEFINED) for t in types]
    merges = spm_merges(tokens, ranks, eligible)
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    unk = _token_name(tokens, meta, "unknown_token_id")
    model = models.BPE(
        vocab=vocab,
        merges=merges,
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(model)
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", not position_ranked))
    if add_prefix:
        # SentencePiece's dummy prefix: one "▁" before every piece of text,
        # even one that starts with a space (llama.cpp also adds it after each
        # special token), then spaces become "▁".
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend(_SPM_SPACE), normalizers.Replace(" ", _SPM_SPACE)]
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace(_SPM_SPACE, " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        tok.normalizer = normalizers.Replace(" ", _SPM_SPACE)
        tok.decoder = decoders.Sequence(
            [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    return tok, True


def build_tokenizer(
    meta: Mapping[str, Any], architecture: str, context_length: int | None = None
) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` equivalent to the GGUF's tokenizer."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    kind = str(meta.get("tokenizer.ggml.model", ""))
    tokens = [str(t) for t in _required(meta, "tokenizer.ggml.tokens")]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)]
    if len(types) != len(tokens):
        raise ConversionError("GGUF tokenizer token types and tokens have different lengths")

    if kind == "gpt2":
        backend, is_spm = _byte_level(meta, tokens)
    elif kind == "llama":
        backend, is_spm = _sentencepiece(meta, tokens, types, architecture)
    else:
        raise ConversionError(
            f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2, llama"
        )

    # Tokens llama.cpp always matches whole in the text.
    special = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind_ in zip(tokens, types)
        if kind_ == CONTROL
    ]
    backend.add_special_tokens(special)
    # User-defined tokens are matched whole too (not special: decoded as text).
    # With a dummy prefix, the text after one of them gets a "▁" prefix, as
    # in llama.cpp and HF's Llama-2 tokenizer (SentencePiece itself adds none).
    backend_vocab = backend.get_vocab()
    user = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind_ in zip(tokens, types)
        if kind_ == USER_DEFINED and tok in backend_vocab and tok.strip(" ")
    ]
    if user:
        backend.add_tokens(user)

    bos = _token_name(tokens, meta, "bos_token_id")
    eos = _token_name(tokens, meta, "eos_token_id")
    unk = _token_name(tokens, meta, "unknown_token_id")
    pad = _token_name(tokens, meta, "padding_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", is_spm))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos is not None) or (add_eos and eos is not None):
        first = [bos] if add_bos and bos is not None else []
        last = [eos] if add_eos and eos is not None else []
        single = " ".join([*first, "$A", *last])
        pair = " ".join([*first, "$A", *last, *first, "$B:1", *last])
        backend.post_processor = processors.TemplateProcessing(
            single=single,
            pair=pair,
            special_tokens=[(t, tokens.index(t)) for t in dict.fromkeys(first + last)],
        )
    elif not is_spm:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)

    kwargs: dict[str, Any] = {
        "tokenizer_object": backend,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    if context_length:
        kwargs["model_max_length"] = int(context_length)
    for name, value in (
        ("bos_token", bos),
        ("eos_token", eos),
        ("unk_token", unk),
        ("pad_token", pad),
    ):
        if value is not None:
            kwargs[name] = value
    tokenizer = PreTrainedTokenizerFast(**kwargs)
    template = meta.get("tokenizer.chat_template")
    if template:
        tokenizer.chat_template = str(template)
    return tokenizer


def save_tokenizer(
    meta: Mapping[str, Any], architecture: str, out_dir: Path, context_length: int | None = None
) -> None:
    """Rebuild the GGUF's tokenizer and save it into ``out_dir``."""
    tokenizer = build_tokenizer(meta, architecture, context_length)
    tokenizer.save_pretrained(str(out_dir))
