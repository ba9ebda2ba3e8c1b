"""Hugging Face ``Trainer`` with FSDP2 HSDP (``fsdp=True``, ``fsdp_config={"version": 2, ...}``, ``ParallelismConfig``
2 x 2) through accelerate: gradientflow's ``fully_shard`` (``fsdp2_with_gradientflow`` around ``train()``) against
the same Trainer running torch's HSDP, on 4 Gloo ranks.

The Trainer builds its own ``Accelerator``, and accelerate enables FSDP only on accelerator devices (accelerate
1.15.0, state.py:986-1016; see test_accelerate_fsdp2.py): :func:`_fsdp2_state_on_cpu` initialises accelerate's
process-wide state first with what that branch sets on GPUs, and the Trainer's own switch for a state set up
beforehand (``accelerator_config={"use_configured_state": True}``) has its ``Accelerator`` find it.  Everything
after is the Trainer's and accelerate's own code: the Trainer's loop, AdamW, ``max_grad_norm`` clipping, its
linear learning-rate decay, accelerate's auto-wrap, the root.  The model: a small ``nn.Module`` LM (the Trainer
trains any module that returns its loss); and a Hugging Face Llama, whose tail (final norm, lm_head) accelerate
shards as one unit of two modules, ``fully_shard([norm, lm_head])``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from _dist import run_distributed  # noqa: E402

NODES, PER_NODE = 2, 2
STEPS, SEQ, VOCAB = 4, 16, 64


class _Tokens(torch.utils.data.Dataset):
    """Seeded random token sequences; the labels are the inputs (causal LM)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class _TinyLM(torch.nn.Module):
    """Embedding, MLP, logits: a causal LM the Trainer trains as any ``nn.Module`` that returns its loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh())
        self.out = torch.nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.out(self.mlp(self.embed(input_ids)))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return {"loss": loss, "logits": logits}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


# the Llama: accelerate's transformer wrap (its _no_split_modules); _TinyLM: size-based, each of its 3 layers a unit
FSDP_CONFIG = {
    True: {"version": 2},
    False: {"version": 2, "auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 500},
}


def _fsdp2_state_on_cpu(parallelism, fsdp_config: dict) -> None:
    """accelerate's state as a multi-GPU launch sets it (state.py:1010-1016, accelerator.py:475-477), on CPU."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    state = Accelerator(cpu=True).state
    # every later AcceleratorState() copies the process state's fields over its own (state.py:919): both say FSDP
    PartialState().distributed_type = state.distributed_type = DistributedType.FSDP
    # the plugin the Trainer builds from fsdp_config={"version": 2} (training_args.py:2826-2860)
    wrap = {"auto_wrap_policy": fsdp_config.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP").lower()}
    if "min_num_params" in fsdp_config:
        wrap["min_num_params"] = fsdp_config["min_num_params"]
    state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True, **wrap)
    state.parallelism_config = parallelism
    state.device_mesh = parallelism.get_device_mesh("cpu")


def _train(rank: int, tmp: str, recipe: str | None, llama: bool = False) -> dict:
    from accelerate.utils import ParallelismConfig
    from torch.distributed.fsdp import FSDPModule
    from transformers import Trainer, TrainingArguments

    import gradientflow.fsdp as gf
    from gradientflow.integrations.accelerate_fsdp import fsdp2_with_gradientflow

    parallelism = ParallelismConfig(dp_replicate_size=NODES, dp_shard_size=PER_NODE)
    _fsdp2_state_on_cpu(parallelism, FSDP_CONFIG[llama])
    args = TrainingArguments(
        output_dir=os.path.join(tmp, recipe or "torch"), use_cpu=True, max_steps=STEPS, per_device_train_batch_size=2,
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
        fsdp=True, fsdp_config=FSDP_CONFIG[llama], parallelism_config=parallelism,
        accelerator_config={"use_configured_state": True},  # the Trainer's switch for a state set up beforehand
    )  # fmt: skip
    trainer = Trainer(model=_llama() if llama else _TinyLM(), args=args, train_dataset=_Tokens())
    if recipe is None:
        trainer.train()
    else:
        with fsdp2_with_gradientflow(trainer.accelerator, compression=recipe):
            trainer.train()
    model = trainer.model
    out: dict = {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}
    out["units"] = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    out["params"] = [p.full_tensor().detach().flatten().tolist() for p in model.parameters()]
    if recipe is not None:
        out["stats"] = gf.comm_stats(model, total=True)
    if llama:  # the tail is one unit: torch's one FSDP state for both modules
        out["tail_one_unit"] = model.model.norm._get_fsdp_state() is model.lm_head._get_fsdp_state()
    return out


def _scenarios(rank: int, world: int, tmp: str) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # accelerate joins the group _dist made
    out = {name: _train(rank, tmp, recipe) for name, recipe in (("torch", None), ("none", "none"), ("3bit", "3bit"))}
    # a Hugging Face model: accelerate shards its tail (final norm, lm_head) as one unit, fully_shard([norm, lm_head])
    out["llama_torch"] = _train(rank, tmp, None, llama=True)
    out["llama"] = _train(rank, tmp, "none", llama=True)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("trainer"))
    return run_distributed(_scenarios, NODES * PER_NODE, tmp, timeout=300, ranks_per_node=PER_NODE)


def test_trainer_none_is_torchs_hsdp_bit_for_bit(results: list[dict]) -> None:
    for r in results:
        # the decoder layers, the embeddings, the tail and the root: accelerate's units, each sharded by gradientflow
        assert r["torch"]["units"] == r["none"]["units"] == r["3bit"]["units"]
        assert r["torch"]["units"] == ["", "embed", "mlp", "mlp.0", "out"], r["torch"]["units"]
        # the same two collectives on the same shards in the same order (module_comm's "none" is HSDP's own AVG
        # all-reduce): the same floats, through the Trainer's clipping and AdamW (tolerance 0)
        assert len(r["torch"]["losses"]) == STEPS
        assert r["none"]["losses"] == r["torch"]["losses"]
        assert r["none"]["params"] == r["torch"]["params"]
        stats = r["none"]["stats"]
        assert stats["sent_bytes"] == stats["dense_sent_bytes"] > 0  # 2 nodes: a ring sends one copy


def test_trainer_3bit_sends_less_and_keeps_replicas_identical(results: list[dict]) -> None:
    for r in results:
        stats = r["3bit"]["stats"]
        assert stats["compression"] == "3bit" and stats["nodes"] == NODES
        # per shard 3 bits a coordinate plus a bf16 scale per 128: 3/32 + 1/256 of fp32, the blocks padded; under a
        # fifth of the dense ring's bytes for these shards (a 1-D parameter's shard of 8 fills one block: 5 bytes)
        assert 0 < stats["sent_bytes"] < stats["dense_sent_bytes"] / 5, stats
        assert r["3bit"]["losses"][0] == r["torch"]["losses"][0]  # logged before any update
        assert r["3bit"]["losses"] != r["torch"]["losses"]
    assert all(r["3bit"]["params"] == results[0]["3bit"]["params"] for r in results[1:])


def test_trainer_trains_a_hugging_face_model_whose_tail_accelerate_shards_as_one_unit(results: list[dict]) -> None:
    for r in results:
        ours, torch_run = r["llama"], r["llama_torch"]
        tail = ["model.norm", "lm_head"]
        assert (
            ours["units"] == torch_run["units"] == ["", "model.embed_tokens", "model.layers.0", "model.layers.1", *tail]
        )
        assert ours["tail_one_unit"] and torch_run["tail_one_unit"]
        assert ours["stats"]["exchanges"] == 4 * STEPS  # embeddings, 2 layers, the tail (the root owns nothing)
        assert len(ours["losses"]) == STEPS
        # the unit of two modules reduced by gradientflow as the others: torch's HSDP's floats (tolerance 0)
        assert ours["losses"] == torch_run["losses"] and ours["params"] == torch_run["params"]
