"""``tierckpt.load`` and ``tierckpt export`` on checkpoints written by real jobs.

- A 2-rank FSDP2 job (gloo, AdamW) saves to one shared tier-1 root and uploads to tier 2
  (SeaweedFS). One process with no process group loads the model from tier 2, reading
  only the model's records (about a third of the checkpoint: AdamW keeps two more copies).
- The same tier-1 root is loaded collectively by 3 FSDP2 ranks (a different world size,
  uneven shards) and every gathered tensor is bit-equal to the trained one.
- A tiny ``LlamaForCausalLM`` trained with tierckpt is exported by the CLI (from tier 1 and
  from tier 2) and ``from_pretrained`` gives the trained model's logits.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import tierckpt
from tests._launch import spawn
from tests._require import require
from tierckpt import Failures, Tier2
from tierckpt._ports import free_port
from tierckpt.share.contents import contents
from tierckpt.share.loader import load
from tierckpt.share.source import open_checkpoint

if TYPE_CHECKING:
    from s3server import S3Server

IN, HIDDEN, OUT = 250, 1000, 10  # ~2 MB of fp32 weights; 1000 and 10 shard unevenly over 3
STEPS = 4  # saves at steps 1 and 3; "latest" is 3
LAST = STEPS - 1
SLACK = 4096  # bytes beyond the model's records, metadata, manifest and marker


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, IN), nn.ReLU(),
                         nn.Linear(IN, OUT))


def _fsdp(model: nn.Sequential) -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _train(rank: int, world: int, port: int, root: str, url: str, dump: str) -> None:
    """Train the FSDP2 MLP, save steps 1 and 3 (uploaded: close() drains), and have rank 0
    write the full trained tensors to ``dump``."""
    _init(rank, world, port)
    try:
        model = _fsdp(_mlp(seed=0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = tierckpt.TrainState(model=model, optimizer=opt)
        data = torch.Generator().manual_seed(100 + rank)
        with tierckpt.CheckpointManager(tier1=root, tier2=Tier2(url, upload_every=1, drain_s=120),
                                        failures=Failures(collective_timeout_s=60)) as ck:
            for step in range(STEPS):
                loss = model(torch.randn(8, IN, generator=data)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if step % 2 == 1:
                    ck.save(step, state)
            ck.wait(120)
            full = get_model_state_dict(model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True))  # collective; empty on ranks > 0
            if rank == 0:
                torch.save(full, dump)
    finally:
        dist.destroy_process_group()


@dataclasses.dataclass(frozen=True)
class Job:
    root: Path
    url: str
    trained: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def s3(s3_server: S3Server) -> Iterator[S3Server]:
    """The session's SeaweedFS with its AWS_* variables set for this module (module-scoped
    fixtures below start jobs that need them; ``s3_env`` is per test)."""
    with pytest.MonkeyPatch.context() as m:
        for k, v in s3_server.env().items():
            m.setenv(k, v)
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            m.delenv(k, raising=False)
        yield s3_server


def _fresh_url(server: S3Server) -> str:
    return f"s3://{server.bucket}/t-load-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def job(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Job:
    base = tmp_path_factory.mktemp("fsdp-job")
    url, dump = _fresh_url(s3), base / "trained.pt"
    spawn(_train, 2, free_port(), str(base / "t1"), url, str(dump), nprocs=2)
    with open_checkpoint(url) as ckpt:  # the drain on close() uploaded the last step
        assert ckpt.step == LAST
    trained = torch.load(dump, weights_only=True)
    assert set(trained) == {f"{i}.{p}" for i in (0, 2, 4) for p in ("weight", "bias")}
    return Job(root=base / "t1", url=url, trained=trained)


def _budget(source: str | Path) -> tuple[int, int, int]:
    """``(model records' bytes, marker + manifest + .metadata bytes, checkpoint bytes)``."""
    with open_checkpoint(source) as ckpt:
        ckpt.metadata()
        overhead = ckpt.bytes_read
        c = contents(ckpt)
        return c.totals()["model"]["stored_bytes"], overhead, c.checkpoint_bytes


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, w in want.items():
        assert torch.equal(got[k], w), k


@pytest.mark.slow
def test_tier2_load_into_a_plain_module_reads_only_the_model(job: Job) -> None:
    model_bytes, overhead, total = _budget(job.url)
    fresh = _mlp(seed=1)
    assert not torch.equal(fresh[0].weight, job.trained["0.weight"])
    r = load(job.url, fresh)
    assert not dist.is_initialized()  # one process, no process group
    assert (r.tier, r.step, r.keys, r.verified) == ("tier2", LAST, ("model",), "chunks")
    assert r.tensors == len(job.trained) and r.checkpoint_bytes == total
    _assert_same(fresh.state_dict(), job.trained)
    assert model_bytes <= r.bytes_read <= model_bytes + overhead + SLACK, \
        (r.bytes_read, model_bytes, overhead)
    assert r.bytes_read < 0.5 * r.checkpoint_bytes, (r.bytes_read, r.checkpoint_bytes)


@pytest.mark.slow
def test_tier2_load_without_a_destination_gives_full_tensors(job: Job) -> None:
    model_bytes, overhead, _ = _budget(job.url)
    r = load(job.url)
    assert (r.tier, r.step) == ("tier2", LAST)
    _assert_same(r.state_dict, job.trained)
    assert model_bytes <= r.bytes_read <= model_bytes + overhead + SLACK
    assert r.bytes_read < 0.5 * r.checkpoint_bytes


def _load_at(rank: int, world: int, port: int, root: str, want: str, out: str) -> None:
    """Load the tier-1 root into this rank's FSDP2 shards (garbage init, different per
    rank), gather full tensors and report which differ from the trained ones."""
    _init(rank, world, port)
    try:
        model = _fsdp(_mlp(seed=50 + rank))
        r = load(root, model)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        trained = torch.load(want, weights_only=True)
        bad = sorted(set(full) ^ set(trained)) + [
            k for k in trained if k in full and not torch.equal(full[k].cpu(), trained[k])]
        Path(out, f"rank{rank}.json").write_text(json.dumps(
            {"bad": bad, "tier": r.tier, "step": r.step, "bytes_read": r.bytes_read}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tier1_load_at_world_size_three(job: Job, tmp_path: Path) -> None:
    want = tmp_path / "trained.pt"
    torch.save(job.trained, want)
    spawn(_load_at, 3, free_port(), str(job.root), str(want), str(tmp_path), nprocs=3)
    model_bytes, overhead, _ = _budget(job.root)
    for rank in range(3):
        doc = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert doc["bad"] == [], (rank, doc)
        assert (doc["tier"], doc["step"]) == ("tier1", LAST)
        assert doc["bytes_read"] <= model_bytes + overhead + SLACK, (rank, doc)
        if rank != 1:  # its shard of every tensor lies inside one of the two saved shards
            assert doc["bytes_read"] < 0.6 * model_bytes + overhead, (rank, doc)


# --- export of a Hugging Face model -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Llama:
    root: Path
    url: str
    config: Path
    model: Any
    ids: torch.Tensor
    logits: torch.Tensor


@pytest.fixture(scope="module")
def llama(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Llama:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:  # pragma: no cover
        require(False, "needs transformers (the dev extra)")
    base = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(3))
    url = _fresh_url(s3)
    with tierckpt.CheckpointManager(tier1=base / "t1", tier2=Tier2(url, drain_s=120)) as ck:
        model.train()
        for _ in range(3):
            loss = model(data, labels=data).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        ck.save(2, tierckpt.TrainState(model=model, optimizer=opt)).wait(120)
    config.save_pretrained(base / "cfg")
    ids = torch.tensor([[1, 5, 9, 33, 2, 63, 0, 17]])
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits
    return Llama(root=base / "t1", url=url, config=base / "cfg" / "config.json",
                 model=model, ids=ids, logits=logits)


def _export(*args: str) -> None:
    from typer.testing import CliRunner

    from tierckpt.cli import load_commands

    result = CliRunner().invoke(load_commands(), ["export", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output


def _sums(out: Path) -> dict[str, str]:
    """``{file: sha256}`` from SHA256SUMS, after ``sha256sum -c`` passed on it."""
    proc = subprocess.run(["sha256sum", "--strict", "-c", "SHA256SUMS"], cwd=out,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = (out / "SHA256SUMS").read_text().splitlines()
    return {name: digest for digest, name in (line.split("  ", 1) for line in lines)}


@pytest.mark.slow
def test_export_from_tier1_loads_with_from_pretrained(llama: Llama, tmp_path: Path) -> None:
    import safetensors.torch as st
    from transformers import LlamaForCausalLM

    require(shutil.which("sha256sum") is not None, "needs sha256sum (coreutils)")
    out = tmp_path / "hf"
    _export("latest", "--tier1", str(llama.root), "--to", str(out), "--hf-config",
            str(llama.config), "--max-shard-size", "20kB")
    sums = _sums(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and set(shards) | {"model.safetensors.index.json",
                                               "config.json"} == set(sums)
    want = llama.model.state_dict()
    got: dict[str, torch.Tensor] = {}
    for shard in shards:
        assert (out / shard).stat().st_size <= 20_000 + 1024  # the limit, plus its header
        part = st.load_file(out / shard)
        assert all(index["weight_map"][k] == shard for k in part)
        got |= part
    _assert_same(got, want)
    loaded = LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = loaded(llama.ids).logits
    assert logits.dtype == torch.float32
    assert torch.equal(logits, llama.logits)
    # the same checkpoint uploaded to tier 2 exports to the same bytes
    out2 = tmp_path / "hf-tier2"
    _export("latest", "--tier2", llama.url, "--to", str(out2), "--hf-config",
            str(llama.config), "--max-shard-size", "20kB")
    assert _sums(out2) == sums


@pytest.mark.slow
def test_bf16_export_matches_the_bf16_cast_model(llama: Llama, tmp_path: Path) -> None:
    import safetensors.torch as st
    from transformers import LlamaForCausalLM

    out, fp32 = tmp_path / "hf-bf16", tmp_path / "hf-fp32"
    for where, extra in ((out, ("--dtype", "bf16")), (fp32, ())):
        _export("latest", "--tier1", str(llama.root), "--to", str(where), "--hf-config",
                str(llama.config), *extra)
    part = st.load_file(out / "model.safetensors")  # 5GB default: one shard
    want = {k: v.to(torch.bfloat16) for k, v in llama.model.state_dict().items()}
    _assert_same(part, want)  # the cast is round-to-nearest-even, as Tensor.to's
    loaded = LlamaForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    # transformers' own cast of the fp32 export: the same bf16 weights and the same model
    # (its rotary inv_freq buffer stays fp32, as it does in ``loaded``): bit-equal
    theirs = LlamaForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16).eval()
    # Module.to(bf16) also casts the fp32 rotary buffers, so its logits differ by a few
    # bf16 ulps (max 0.002 here on logits of magnitude < 1): compared with a tolerance
    cast = copy.deepcopy(llama.model).to(torch.bfloat16).eval()
    with torch.no_grad():
        got, ref, naive = (m(llama.ids).logits for m in (loaded, theirs, cast))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ref)
    torch.testing.assert_close(got, naive, atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(got.float(), llama.logits, atol=2e-2, rtol=5e-2)
