"""Drafter layers started from the target's own decoder layers: extract --keep-layers saves them in
the store, train --init-layers copies them into the drafter (the target itself is never loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from extract.config import ExtractConfig
from extract.run import run as extract
from target.loader import load_target
from tests.helpers import tiny_target_dir, write_chats
from train.config import TrainConfig
from train.trainer import Trainer

# the drafter's name of a layer weight -> the transformers decoder layer's
NAMES = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
         "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
         "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
         "down_proj": "mlp.down_proj"}


def _store(tmp_path: Path, arch: str, keep: tuple[int, ...]) -> tuple[str, str]:
    target = tiny_target_dir(tmp_path / "t", arch, num_layers=4, hidden=32)
    data = write_chats(tmp_path / "c.jsonl", 8, cyclic=True)
    store = str(tmp_path / "s.zarr")
    extract(ExtractConfig(store=store, target=target, data=data, layers=(0, 2), keep_layers=keep, max_len=256,
                          min_supervised=4, token_budget=1024, rows_per_shard=256))
    return target, store


def _cfg(store: str, out: Path, **kw) -> TrainConfig:
    return TrainConfig(**{**dict(store=store, out=str(out), num_layers=2, block_size=4, num_anchors=16, epochs=1,
                                 token_budget=1024, workers=0, val_samples=0), **kw})


def _started(cfg: TrainConfig) -> Trainer:
    """A trainer whose drafter holds the run's first weights (what its resume() loads)."""
    trainer = Trainer(cfg)
    trainer.resume()
    return trainer


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_drafter_layers_start_as_the_kept_target_layers(tmp_path, arch):
    target, store = _store(tmp_path, arch, keep=(1, 3))
    t = load_target(target, device=torch.device("cpu"), dtype=torch.float32).model
    init, fresh = (_started(_cfg(store, tmp_path / d, **kw)).model
                   for d, kw in (("init", {"init_layers": (3, 1)}), ("fresh", {})))
    for j, lid in enumerate((3, 1)):
        theirs = dict(t.model.layers[lid].named_parameters())
        mine = init.layers[j]
        for name, hf in NAMES.items():
            assert torch.equal(getattr(mine, name).weight, theirs[f"{hf}.weight"]), (j, name)
        for name in ("q_norm", "k_norm"):  # Qwen3 layers have them; a Llama layer's drafter copy starts at ones
            want = theirs.get(f"self_attn.{name}.weight", torch.ones_like(getattr(mine, name).weight))
            assert torch.equal(getattr(mine, name).weight, want), (j, name)
        assert not torch.equal(fresh.layers[j].q_proj.weight, mine.q_proj.weight)
    assert torch.equal(init.norm.weight, t.model.norm.weight)
    # the context projection starts as a fresh run's: the same seed draws it
    assert torch.equal(init.fc.weight, fresh.fc.weight)


def test_layers_not_kept_or_of_another_shape_are_refused_in_one_line(tmp_path):
    _, store = _store(tmp_path, "llama", keep=(1, 3))
    from click.testing import CliRunner

    from cache_format.__main__ import cli as cache_cli

    shown = CliRunner().invoke(cache_cli, ["inspect", store])
    assert shown.exit_code == 0 and "kept layers  [1, 3]" in shown.output, shown.output
    with pytest.raises(ValueError, match=r"s\.zarr: --init-layers: target layer 2 is not kept in the store "
                                         r"\(it keeps \[1, 3\]; extract with --keep-layers\)"):
        _started(_cfg(store, tmp_path / "a", init_layers=(1, 2)))
    with pytest.raises(ValueError, match=r"--init-layers \[1, 3\]: the weights do not fit this drafter") as e:
        _started(_cfg(store, tmp_path / "b", init_layers=(1, 3), intermediate_size=48))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="one layer id >= 0 per drafter layer"):
        _cfg(store, tmp_path / "c", init_layers=(1,))
    with pytest.raises(ValueError, match="give one"):
        _cfg(store, tmp_path / "d", init_layers=(1, 3), init_from=str(tmp_path))


def test_a_layer_id_the_target_lacks_is_refused_before_the_store_exists(tmp_path):
    target = tiny_target_dir(tmp_path / "t", "llama", num_layers=4, hidden=32)
    data = write_chats(tmp_path / "c.jsonl", 4)
    store = tmp_path / "s.zarr"
    with pytest.raises(ValueError, match=r"keep_layers: layer id 9 out of range: target has 4 decoder layers"):
        extract(ExtractConfig(store=str(store), target=target, data=data, layers=(0, 2), keep_layers=(9,), max_len=256,
                              min_supervised=4, token_budget=1024))
    assert not (store / "zarr.json").exists()
    with pytest.raises(ValueError, match="keep_layers must be distinct and >= 0"):
        ExtractConfig(store=str(store), keep_layers=(1, 1))
