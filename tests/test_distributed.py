"""Multi-process training on the CPU with gloo: two processes train exactly as one on the same
global batches, their checkpoint resumes in one process, and the fused ops work under
DistributedDataParallel's gradient hooks and ``no_sync`` accumulation, and under FSDP2's
``fully_shard`` per layer."""
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastformer.jobs import checkpoint as ckpt
from fastformer.jobs.distributed import World, shard_rows, step_seed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--task-train", "120", "--task-test", "4", "--preset", "tiny", "--dropout", "0", "--no-progress",
        "--threads", "1", "--beam", "1"]


def _train(out, *extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "fastformer", "train", *TINY, "--out", str(out), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"train {extra} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return ckpt.load(str(out)), proc.stdout


def _assert_same_model(a, b, atol):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process for 3 steps, two processes (the --nproc shortcut, i.e. torchrun) for 3 steps,
    then each checkpoint resumed in one process up to step 5."""
    root = tmp_path_factory.mktemp("ddp")
    one, one_out = _train(root / "one", "--steps", "3")
    two, two_out = _train(root / "two", "--steps", "3", "--nproc", "2")
    shutil.copytree(root / "one", root / "one_then_one")
    shutil.copytree(root / "two", root / "two_then_one")
    one_resumed, _ = _train(root / "one_then_one", "--steps", "5", "--resume")
    two_resumed, _ = _train(root / "two_then_one", "--steps", "5", "--resume")
    return dict(one=one, two=two, one_out=one_out, two_out=two_out, one_resumed=one_resumed,
                two_resumed=two_resumed)


def test_two_processes_train_as_one_on_the_same_global_batches(runs):
    one, two = runs["one"], runs["two"]
    assert two["step"] == one["step"] == 3 and two["data_position"] == one["data_position"]
    # the logged loss is the mean over the whole global batch, as one process computes it
    torch.testing.assert_close(torch.tensor(two["history"]), torch.tensor(one["history"]), atol=1e-5, rtol=1e-5)
    # the same updates: gradients differ only by the order of the all-reduce's summation
    _assert_same_model(two["model"], one["model"], atol=3e-5)
    assert "2 processes" in runs["two_out"] and "2 processes" not in runs["one_out"]
    assert runs["two_out"].count("fastformer train:") == 1, "only rank 0 prints"


def test_a_two_process_checkpoint_resumes_in_one_process(runs):
    one, two = runs["one_resumed"], runs["two_resumed"]
    assert two["step"] == one["step"] == 5
    torch.testing.assert_close(torch.tensor(two["history"]), torch.tensor(one["history"]), atol=1e-5, rtol=1e-5)
    _assert_same_model(two["model"], one["model"], atol=5e-5)


@pytest.mark.parametrize("batch,size", [(5, 2), (1, 2), (7, 3), (3, 3), (1, 1)])
def test_shards_are_disjoint_and_cover_the_batch(batch, size):
    seen = []
    for rank in range(size):
        rows, counts = shard_rows(batch, World(rank=rank, size=size))
        if counts:
            seen += rows
        else:  # a rank without a sentence of its own trains on row 0 with weight 0
            assert rows == [0] and batch < size
    assert sorted(seen) == list(range(batch))


def test_step_seeds_differ_between_ranks_and_steps():
    seeds = {step_seed(0, step, rank) for step in range(50) for rank in range(8)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)


def _no_sync_worker(rank, size, store_path, result_path):
    """Each rank: a fastformer model under DDP accumulates two micro-batches (no_sync on the
    first); rank 0 saves the averaged gradients."""
    from torch.nn.parallel import DistributedDataParallel

    from fastformer.models import Seq2SeqTransformer
    from fastformer.jobs.train import LossModule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=size)
    torch.manual_seed(0)
    model = Seq2SeqTransformer(20, 20, d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=64, dropout=0.0)
    ddp = DistributedDataParallel(LossModule(model, 0.1))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(3, 20, (4, 6), generator=gen), torch.randint(3, 20, (4, 5), generator=gen))
               for _ in range(2 * size)]
    mine = batches[2 * rank: 2 * rank + 2]
    with ddp.no_sync():
        (ddp(*mine[0]) / 2).backward()
    (ddp(*mine[1]) / 2).backward()
    if rank == 0:
        torch.save({n: p.grad for n, p in model.named_parameters()}, result_path)
    dist.destroy_process_group()


def test_fused_ops_under_ddp_hooks_and_no_sync(tmp_path):
    size = 2
    mp.spawn(_no_sync_worker, args=(size, str(tmp_path / "store"), str(tmp_path / "grads.pt")), nprocs=size)
    got = torch.load(tmp_path / "grads.pt")
    # the same model and micro-batches in one process: the mean of the four micro-batch losses
    from fastformer.models import Seq2SeqTransformer

    torch.manual_seed(0)
    model = Seq2SeqTransformer(20, 20, d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=64, dropout=0.0)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(3, 20, (4, 6), generator=gen), torch.randint(3, 20, (4, 5), generator=gen))
               for _ in range(2 * size)]
    sum(model.loss(s, t, label_smoothing=0.1) for s, t in batches).div(2 * size).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def _fsdp_worker(rank, size, store_path, result_path):
    """Each rank: the model with every encoder/decoder layer and the whole loss module sharded by
    FSDP2's ``fully_shard`` (gloo, CPU); one backward on this rank's batch, then the full
    (all-gathered) gradients are saved by rank 0."""
    from torch.distributed.fsdp import fully_shard

    from fastformer.jobs.train import LossModule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=size)
    model = _small_model()
    loss_module = LossModule(model, 0.1)
    for stack in (model.encoder, model.decoder):
        for layer in stack.layers:
            fully_shard(layer)
    fully_shard(loss_module)
    src, tgt = _batches(size)[rank]
    loss_module(src, tgt).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(grads, result_path)
    dist.destroy_process_group()


def _small_model():
    from fastformer.models import Seq2SeqTransformer

    torch.manual_seed(0)
    return Seq2SeqTransformer(20, 20, d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                              dim_feedforward=64, dropout=0.0, norm_first=True)


def _batches(n):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(3, 20, (4, 6), generator=gen), torch.randint(3, 20, (4, 5), generator=gen))
            for _ in range(n)]


def test_fused_ops_under_fsdp_fully_shard(tmp_path):
    size = 2
    mp.spawn(_fsdp_worker, args=(size, str(tmp_path / "store"), str(tmp_path / "grads.pt")), nprocs=size)
    got = torch.load(tmp_path / "grads.pt")
    model = _small_model()  # one process, both batches: FSDP averages the ranks' gradients
    sum(model.loss(s, t, label_smoothing=0.1) for s, t in _batches(size)).div(size).backward()
    assert got.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
