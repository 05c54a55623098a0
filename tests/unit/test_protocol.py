"""Per-item state machine and the compatibility handshake."""

import itertools
import json
import os

import pytest

from ectransfer.protocol import (
    _ALLOWED,
    CompatError,
    ItemTransfer,
    ProtocolError,
    TransferState,
    check_compat,
    make_compat,
)

pytestmark = pytest.mark.unit

S = TransferState
# Written out independently of _ALLOWED so that a change to the table shows up here.
LEGAL = {
    (S.RESERVED, S.RECEIVING), (S.RESERVED, S.LANDED), (S.RESERVED, S.FAILED), (S.RESERVED, S.CANCELLED),
    (S.RECEIVING, S.LANDED), (S.RECEIVING, S.FAILED), (S.RECEIVING, S.CANCELLED),
    (S.LANDED, S.LOADING), (S.LANDED, S.LOST), (S.LANDED, S.FAILED), (S.LANDED, S.CANCELLED),
    (S.LOST, S.LOADING), (S.LOST, S.FAILED), (S.LOST, S.CANCELLED),
    (S.LOADING, S.DONE),
}  # fmt: skip
ALL_PAIRS = list(itertools.product(S, repeat=2))


def test_the_table_matches_the_documented_transitions():
    assert {(a, b) for a, targets in _ALLOWED.items() for b in targets} == LEGAL
    assert set(_ALLOWED) == set(S)


@pytest.mark.parametrize("src, dst", [p for p in ALL_PAIRS if p in LEGAL], ids=lambda s: s.value)
def test_legal_transition_succeeds(src, dst):
    item = ItemTransfer("id", 10, state=src)
    item.advance(dst)
    assert item.state is dst
    assert item.error is None


@pytest.mark.parametrize("src, dst", [p for p in ALL_PAIRS if p not in LEGAL], ids=lambda s: s.value)
def test_illegal_transition_raises_and_keeps_the_state(src, dst):
    item = ItemTransfer("id", 10, state=src)
    with pytest.raises(ProtocolError, match=f"{src.value} -> {dst.value}"):
        item.advance(dst, "boom")
    assert item.state is src
    assert item.error is None


def test_terminal_states():
    assert {s for s in S if s.terminal} == {S.DONE, S.FAILED, S.CANCELLED}
    assert all(not _ALLOWED[s] for s in S if s.terminal)


def test_a_full_happy_path_and_error_recording():
    item = ItemTransfer("id", 10)
    assert item.state is S.RESERVED
    for s in (S.RECEIVING, S.LANDED, S.LOADING, S.DONE):
        item.advance(s)
    assert item.state is S.DONE
    other = ItemTransfer("id2", 10)
    other.advance(S.RECEIVING, "note")
    other.advance(S.LANDED)  # no error given: the earlier one is kept
    assert other.error == "note"


@pytest.mark.parametrize("src", [s for s in S if not s.terminal and s is not S.LOADING], ids=lambda s: s.value)
def test_fail_from_a_live_state_moves_to_failed(src):
    item = ItemTransfer("id", 10, state=src)
    item.fail("stream broke")
    assert item.state is S.FAILED and item.error == "stream broke"


@pytest.mark.parametrize("src", [s for s in S if s.terminal or s is S.LOADING], ids=lambda s: s.value)
def test_fail_is_a_no_op_on_terminal_states_and_while_loading(src):
    item = ItemTransfer("id", 10, state=src, error="first")
    item.fail("second")
    item.fail("third")
    assert item.state is src and item.error == "first"


# --- compatibility ---------------------------------------------------------------------------------------------

BASE = {"vllm_version": "0.32.0", "model": "org/model", "dtype": "bfloat16", "embed_width": 2048}


def compat(**changes):
    return make_compat(**{**BASE, **changes})


def model_dir(root, name, config):
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def test_same_inputs_give_the_same_hash_and_are_compatible():
    a, b = compat(), compat()
    assert a.hash == b.hash and len(a.hash) == 64
    assert (a.model, a.dtype, a.embed_width, a.vllm_version) == ("org/model", "bfloat16", 2048, "0.32.0")
    check_compat(a, b)


@pytest.mark.parametrize(
    "field, value", [("dtype", "float16"), ("embed_width", 4096), ("vllm_version", "0.33.0"), ("model", "org/other")]
)
def test_a_different_field_is_incompatible_and_named(field, value):
    local, remote = compat(), compat(**{field: value})
    assert local.hash != remote.hash
    with pytest.raises(CompatError, match=rf"{field}: here .*, peer {value!r}"):
        check_compat(local, remote)
    with pytest.raises(CompatError, match=field):
        check_compat(remote, local)


def test_every_differing_field_is_named():
    with pytest.raises(CompatError) as e:
        check_compat(compat(), compat(dtype="float32", embed_width=1))
    assert "dtype" in str(e.value) and "embed_width" in str(e.value) and "vllm_version" not in str(e.value)


def test_different_model_configs_are_incompatible(tmp_path):
    a = model_dir(tmp_path, "a", {"hidden_size": 64})
    b = model_dir(tmp_path, "b", {"hidden_size": 128})
    with pytest.raises(CompatError, match="model: here"):
        check_compat(compat(model=a), compat(model=b))


def test_same_directory_whose_config_changed_is_incompatible(tmp_path):
    d = model_dir(tmp_path, "m", {"hidden_size": 64})
    before = compat(model=d)
    (tmp_path / "m" / "config.json").write_text(json.dumps({"hidden_size": 65}))
    with pytest.raises(CompatError, match="model files differ"):
        check_compat(before, compat(model=d))


def test_two_directories_with_identical_config_are_compatible(tmp_path):
    cfg = {"hidden_size": 64, "architectures": ["Idefics3ForConditionalGeneration"]}
    a, b = compat(model=model_dir(tmp_path, "a", cfg)), compat(model=model_dir(tmp_path, "b", cfg))
    assert a.model != b.model
    assert a.hash == b.hash
    check_compat(a, b)


def _weights_dir(root, name, seed=0, tokenizer="{}"):
    import torch
    from safetensors.torch import save_file

    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (d / "tokenizer_config.json").write_text(tokenizer)
    g = torch.Generator().manual_seed(seed)
    save_file({"vision.w": torch.randn(64, 64, generator=g), "lm.w": torch.randn(256, 64, generator=g)},
              str(d / "model.safetensors"))
    return str(d)


def test_a_fine_tune_with_the_same_config_and_shapes_is_incompatible(tmp_path):
    base, tuned = _weights_dir(tmp_path, "base", seed=0), _weights_dir(tmp_path, "tuned", seed=1)
    assert os.path.getsize(os.path.join(base, "model.safetensors")) == \
        os.path.getsize(os.path.join(tuned, "model.safetensors"))  # same header, same size: only values differ
    assert compat(model=base).hash != compat(model=tuned).hash
    with pytest.raises(CompatError, match="model"):
        check_compat(compat(model=base), compat(model=tuned))


def test_a_copy_of_the_same_weights_elsewhere_is_compatible(tmp_path):
    a, b = _weights_dir(tmp_path, "a", seed=3), _weights_dir(tmp_path, "b", seed=3)
    check_compat(compat(model=a), compat(model=b))


def test_a_different_tokenizer_config_is_incompatible(tmp_path):
    a = _weights_dir(tmp_path, "a")
    b = _weights_dir(tmp_path, "b", tokenizer='{"added": "<x>"}')
    assert compat(model=a).hash != compat(model=b).hash


def test_hold_makes_a_check_and_the_work_on_it_atomic():
    """The client's demote (check LANDED in place, copy to staging) and the scheduler's move to
    LOADING exclude each other: a transition waits while another thread holds the item."""
    import threading

    item = ItemTransfer("id", 10, state=S.LANDED)
    taken = threading.Event()

    def scheduler() -> None:
        item.try_advance(S.LOADING)
        taken.set()

    with item.hold():
        t = threading.Thread(target=scheduler)
        t.start()
        assert not taken.wait(0.2)  # blocked while the demote runs
        assert item.state is S.LANDED
    t.join(30)
    assert taken.is_set() and item.state is S.LOADING
    assert not item.try_advance(S.LOST)  # once taken, the client cannot mark it lost
