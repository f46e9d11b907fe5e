"""modeling.model.hub.resolve_model: local directories and Hub ids, against a fake Hub cache (no network).

The cache is laid out as huggingface_hub writes it: ``models--org--name/blobs/<sha256>``,
``snapshots/<commit>/<file>`` (symlinks to the blobs) and ``refs/<branch or tag>`` (the commit).
Every test runs with HF_HUB_OFFLINE=1 and HF_HUB_CACHE in a temporary folder; the tests that
exercise the online path replace ``snapshot_download``'s network part with a stub that fails.
"""

import hashlib
import os
import shutil
from pathlib import Path

import huggingface_hub
import pytest

from modeling.model.hub import ALLOW_PATTERNS, ModelNotFound, hub_cache_dir, is_hub_id, resolve_model
from modeling.model.random_checkpoint import build_random_checkpoint

OLD = "1" * 40
NEW = "a" * 40


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", num_hidden_layers=1,
                                   hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=32)


def add_snapshot(cache: Path, repo_id: str, src: Path, commit: str, refs=("main",), skip=()) -> Path:
    """Put the files of ``src`` into ``cache`` as the snapshot ``commit`` of ``repo_id``."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.name in skip:
            continue
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return root


@pytest.fixture
def calls(monkeypatch):
    """Records snapshot_download's calls; a call that may use the network raises ConnectionError."""
    real = huggingface_hub.snapshot_download
    seen = []

    def fake(repo_id, **kwargs):
        seen.append(kwargs)
        if not kwargs.get("local_files_only"):
            raise ConnectionError("no network in tests")
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    return seen


def test_hub_id_from_the_offline_cache(cache, checkpoint, calls):
    snap = add_snapshot(cache, "org/tiny", checkpoint, NEW)
    path = resolve_model("org/tiny")
    assert path == snap
    assert (path / "config.json").read_bytes() == (checkpoint / "config.json").read_bytes()
    assert calls and all(c["local_files_only"] for c in calls)  # HF_HUB_OFFLINE=1: never online
    assert calls[0]["allow_patterns"] == ALLOW_PATTERNS and calls[0]["cache_dir"] == str(cache)


def test_loads_like_a_local_checkpoint(cache, checkpoint, calls):
    from modeling.api.tokenizer import QwenTokenizer

    add_snapshot(cache, "org/tiny", checkpoint, NEW)
    a = QwenTokenizer.from_pretrained(resolve_model("org/tiny"))
    b = QwenTokenizer.from_pretrained(checkpoint)
    assert a.encode("Hello world") == b.encode("Hello world") and a.eos_token_ids == b.eos_token_ids


def test_revision_pinning(cache, checkpoint, calls):
    old = add_snapshot(cache, "org/tiny", checkpoint, OLD, refs=("v1",))
    new = add_snapshot(cache, "org/tiny", checkpoint, NEW, refs=("main",))
    assert resolve_model("org/tiny") == new
    assert resolve_model("org/tiny", revision="main") == new
    assert resolve_model("org/tiny", revision="v1") == old
    assert resolve_model("org/tiny", revision=OLD) == old
    offline = r"org/tiny@v2: not in the local Hub cache .* offline mode is on \(HF_HUB_OFFLINE=1\)$"
    with pytest.raises(ModelNotFound, match=offline):
        resolve_model("org/tiny", revision="v2")
    with pytest.raises(ModelNotFound, match="org/tiny@" + "b" * 40):
        resolve_model("org/tiny", revision="b" * 40)


def test_missing_model_is_one_clear_line(cache, calls):
    with pytest.raises(ModelNotFound) as e:
        resolve_model("org/absent")
    msg = str(e.value)
    assert isinstance(e.value, ValueError) and "\n" not in msg
    assert msg.startswith("org/absent: not in the local Hub cache") and str(cache) in msg and "offline" in msg


def test_snapshot_without_tokenizer(cache, checkpoint, calls):
    add_snapshot(cache, "org/notok", checkpoint, NEW, skip=("tokenizer.json",))
    with pytest.raises(ModelNotFound, match=r"'org/notok' \(.*\) has no tokenizer.json$"):
        resolve_model("org/notok")
    add_snapshot(cache, "org/bare", checkpoint, NEW, skip=("tokenizer.json", "config.json"))
    with pytest.raises(ModelNotFound, match="has no config.json and no tokenizer.json"):
        resolve_model("org/bare")


def test_offline_argument_overrides_the_environment(cache, checkpoint, calls, monkeypatch):
    snap = add_snapshot(cache, "org/tiny", checkpoint, NEW)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert resolve_model("org/tiny", offline=True) == snap
    assert all(c["local_files_only"] for c in calls)


def test_no_network_falls_back_to_the_cache(cache, checkpoint, calls, monkeypatch):
    snap = add_snapshot(cache, "org/tiny", checkpoint, NEW)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert resolve_model("org/tiny", progress=False) == snap
    assert [bool(c.get("local_files_only")) for c in calls] == [False, True]
    assert "tqdm_class" in calls[0]
    with pytest.raises(ModelNotFound, match=r"org/absent: not in the local Hub cache .* the Hub could not be "
                                            r"reached \(ConnectionError: no network in tests\)"):
        resolve_model("org/absent")


def test_hub_errors_become_model_not_found(cache, monkeypatch):
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE")
    for error, expected in [(RepositoryNotFoundError, "org/x: no such model on the Hub"),
                            (GatedRepoError, "org/x: a gated model"),
                            (RevisionNotFoundError, "org/x: the Hub has no revision .main.")]:
        def fake(repo_id, error=error, **kwargs):
            raise error.__new__(error)  # constructing one needs an HTTP response

        monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
        with pytest.raises(ModelNotFound, match=expected):
            resolve_model("org/x")


def test_local_directory(tmp_path, checkpoint, cache, calls):
    assert resolve_model(checkpoint) == checkpoint
    assert resolve_model(str(checkpoint)) == checkpoint
    assert not calls  # never looked up on the Hub
    with pytest.raises(ModelNotFound, match="a revision .* applies to Hub ids only"):
        resolve_model(checkpoint, revision="main")

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelNotFound, match=r"partial' has no config.json$"):
        resolve_model(partial)
    with pytest.raises(ModelNotFound, match="is not a directory"):
        resolve_model(partial / "tokenizer.json")
    for name in (str(tmp_path / "nope"), "./nope", "a/b/c", "org/..", " "):
        with pytest.raises(ModelNotFound):
            resolve_model(name)
    with pytest.raises(ModelNotFound, match="no such directory, and not a Hub id"):
        resolve_model(str(tmp_path / "nope"))


def test_hub_id_ending_in_a_dot_is_refused(cache, checkpoint, calls):
    """The Hub refuses names that end in "."; a snapshot spelled so in the cache is never used."""
    add_snapshot(cache, "org/tiny.", checkpoint, NEW)
    with pytest.raises(ModelNotFound, match=r"^'org/tiny\.': no such directory, and not a Hub id of the form "
                                            r"ORG/NAME$"):
        resolve_model("org/tiny.")
    assert not calls


def test_snapshot_whose_blob_is_gone_names_the_file(cache, checkpoint, calls):
    """A snapshot link to a blob that is missing (an interrupted download) is named, not taken for
    an absent file."""
    snap = add_snapshot(cache, "org/tiny", checkpoint, NEW)
    (snap / "tokenizer.json").resolve().unlink()
    with pytest.raises(ModelNotFound, match=r"^'org/tiny' \(.*\): tokenizer.json is a link to .*blobs/\w+, which does "
                                            r"not exist$"):
        resolve_model("org/tiny")


def test_local_directory_wins_over_hub_id(tmp_path, checkpoint, cache, calls, monkeypatch):
    add_snapshot(cache, "org/tiny", checkpoint, NEW)
    local = tmp_path / "work" / "org" / "tiny"
    shutil.copytree(checkpoint, local)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model("org/tiny") == Path("org/tiny")
    assert not calls


def test_names_and_cache_dir(monkeypatch, tmp_path):
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("org/name_v1.5")
    for name in ("Qwen3-0.6B", "/abs/dir", "./rel/dir", "a/b/c", "org/..", "../x", "org/", "/x", "org/name.",
                 "org/name_v1."):
        assert not is_hub_id(name), name
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub_cache_dir() == tmp_path / "c"
