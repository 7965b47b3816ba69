"""Tokenizers: loaded through transformers, and built in the project for synthetic tasks.

Nothing comes from a hub: `load_tokenizer` reads a local directory only, and
`build_char_tokenizer` writes one (tokenizer.json + tokenizer_config.json, the Hugging
Face format) that `transformers.AutoTokenizer.from_pretrained(dir)` loads offline.
"""
from __future__ import annotations

import json
import os
from typing import Sequence

from tokenizers import Tokenizer, decoders, models, processors

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
# Ids 0..3, fixed so that configs and tests may rely on them.
BASE_SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


# The class transformers 5 writes for a tokenizer with no model-specific class (every
# tokenizer the project builds): loaded by that class directly. AutoTokenizer gives the
# same object but first imports transformers' model configs, and with them torch where it
# is installed: 3 s of CPU in every process that loads a tokenizer.
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str):
    """A transformers tokenizer from a local directory (never the hub)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Tokenizer directory {path!r} does not exist.")
    import transformers
    cls = getattr(transformers, _tokenizer_class(path) or "", None)
    if cls is None or cls.__name__ not in _GENERIC_CLASSES:
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(path, local_files_only=True)


def _tokenizer_class(path: str) -> str | None:
    """tokenizer_config.json's tokenizer_class, None without one."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def build_char_tokenizer(out_dir: str, alphabet: Sequence[str], extra_special_tokens: Sequence[str] = (),
                         add_bos: bool = True):
    """Writes a character-level tokenizer to `out_dir` and returns it as loaded back.

    Ids: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then `extra_special_tokens` (e.g. "<think>",
    "</think>"; each encodes to one id wherever it appears in text), then one id per
    distinct character of `alphabet`, in order. Characters outside the alphabet encode
    to <unk>. With `add_bos`, encoding with special tokens prepends <bos> (as Llama's
    tokenizers do); <eos> is never added, the caller decides where text ends.
    Decoding concatenates characters with no added spaces.
    """
    from transformers import PreTrainedTokenizerFast
    specials = list(BASE_SPECIAL_TOKENS) + [t for t in extra_special_tokens if t not in BASE_SPECIAL_TOKENS]
    chars = list(dict.fromkeys(alphabet))
    bad = [c for c in chars if len(c) != 1]
    if bad:
        raise ValueError(f"alphabet entries must be single characters; got {bad[:5]}.")
    vocab = {token: i for i, token in enumerate(specials + chars)}
    # BPE without merges splits text into characters; no pre-tokenizer keeps spaces and
    # newlines as ordinary characters.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Fuse()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        extra_special_tokens=specials[len(BASE_SPECIAL_TOKENS):],
        clean_up_tokenization_spaces=False)  # it would rewrite " ." as "." on decode
    os.makedirs(out_dir, exist_ok=True)
    wrapped.save_pretrained(out_dir)
    return load_tokenizer(out_dir)


# ChatML, the format of Qwen2.5's chat template (without its tool-calling branches).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_bpe_tokenizer(out_dir: str, texts, vocab_size: int = 512):
    """Trains a byte-level BPE tokenizer on `texts` (an iterable of strings) and writes it
    to `out_dir` in the Hugging Face format, shaped like Qwen2.5-Instruct's: the special
    tokens <|endoftext|> (also padding), <|im_start|> and <|im_end|> (eos), the ChatML chat
    template, no <bos>. Returns it as loaded back. Any byte sequence encodes (no <unk>)."""
    from tokenizers import pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHATML_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                      clean_up_tokenization_spaces=False)
    wrapped.chat_template = CHATML_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    wrapped.save_pretrained(out_dir)
    return load_tokenizer(out_dir)


def end_token_ids(tokenizer, model_end_ids=()) -> tuple[int, ...]:
    """Every end token of a model and its tokenizer, the tokenizer's eos first: what the
    engine stops on and completions are cut at. The first is what SFT appends to a
    solution (a chat model's end of turn, e.g. <|im_end|> or <|eot_id|>, where the
    checkpoint's config lists <|end_of_text|> first)."""
    eos = tokenizer.eos_token_id
    ids = ([eos] if eos is not None else []) + [int(i) for i in model_end_ids if i != eos]
    if not ids:
        raise ValueError("Neither the model's config nor its tokenizer names an end token; set eos_token_id in the "
                         "checkpoint's config.json or generation_config.json.")
    return tuple(ids)
