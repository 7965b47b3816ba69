"""The character tokenizer: fixed special ids, exact round trips, offline AutoTokenizer loading."""
import pytest
import transformers

from tlt_jax import tokenizer as tk

ALPHABET = "0123456789+-=*/ .,?\nabcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tk.build_char_tokenizer(str(tmp_path_factory.mktemp("tok")), ALPHABET,
                                   extra_special_tokens=("<think>", "</think>"))


def test_ids_and_round_trip(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.convert_tokens_to_ids(["<think>", "</think>", "0"]) == [4, 5, 6]
    assert len(tok) == 6 + len(ALPHABET)
    text = "what is 12 + 30 ?\n<think>12 + 30 = 42 .</think> 42 , done"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(4) == 1 and ids.count(5) == 1
    assert len(ids) == 1 + len(text) - len("<think></think>") + 2  # one id per character or marker
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + text
    assert tok.decode(ids[1:]) == text  # spaces before punctuation are kept
    assert tok("ab", add_special_tokens=False)["input_ids"] == tok.convert_tokens_to_ids(["a", "b"])


def test_unknown_characters_and_padding(tok):
    assert tok("aZb", add_special_tokens=False)["input_ids"][1] == tok.unk_token_id
    batch = tok(["ab", "abcd"], padding=True)["input_ids"]
    assert batch[0][-2:] == [tok.pad_token_id] * 2 and len(batch[0]) == len(batch[1])


def test_saved_directory_loads_offline_with_auto_tokenizer(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = str(tmp_path / "t")
    tk.build_char_tokenizer(path, "ab", add_bos=False)
    loaded = transformers.AutoTokenizer.from_pretrained(path)
    assert loaded("abba")["input_ids"] == [4, 5, 5, 4]
    assert loaded.decode([4, 5, 2], skip_special_tokens=True) == "ab"


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="single characters"):
        tk.build_char_tokenizer(str(tmp_path / "x"), ["a", "bc"])
    with pytest.raises(FileNotFoundError):
        tk.load_tokenizer(str(tmp_path / "missing"))


def test_load_tokenizer_gives_what_auto_tokenizer_gives(tok, tmp_path):
    """The project's tokenizers load by their own class, as AutoTokenizer would load them;
    a directory whose tokenizer names another class goes through AutoTokenizer."""
    bpe = tk.build_bpe_tokenizer(str(tmp_path / "bpe"), ["12 + 30 = 42, hello world"] * 8, vocab_size=280)
    for path in (tok.name_or_path, bpe.name_or_path):
        ours, auto = tk.load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        assert type(ours) is type(auto)
        assert ours.init_kwargs == auto.init_kwargs and ours.chat_template == auto.chat_template
        text = "<think>12 + 30 = 42</think> hello<|im_end|>"
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
    assert tk._tokenizer_class(str(tmp_path)) is None  # no tokenizer_config.json: AutoTokenizer decides


def test_a_launcher_s_tokenizer_and_metrics_import_no_torch(tok, tmp_path):
    """torch (installed for the tests' reference models) costs 2-3 s of CPU in every process
    that imports it: loading a tokenizer and writing TensorBoard metrics import none."""
    import subprocess
    import sys
    code = ("import sys\nfrom tlt_jax import metrics, tokenizer\n"
            f"tokenizer.load_tokenizer({tok.name_or_path!r})\n"
            f"with metrics.MetricsWriter({str(tmp_path)!r}) as w:\n    w.write(1, {{'loss': 0.5}})\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "tensorboard").is_dir()
