"""``python -m fastformer train``: train a Seq2SeqTransformer, checkpoint it, and score it.

With no options it learns the built-in ``dates`` task (English dates in many surface forms ->
ISO dates, generated on the fly) with a character tokenizer, then prints exact-match accuracy,
BLEU and example translations on a held-out split whose dates never occur in training.

Determinism: the data (task and split), the tokenizers, the batch order of every epoch, the
model initialisation and every dropout mask follow from ``--seed``. A checkpoint stores the
model, optimizer, scheduler, RNG states and the data position ``(epoch, batch)``, so
``--resume`` continues with exactly the batches and random numbers an uninterrupted run
would have used, and gives the same loss curve.
"""
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import checkpoint as ckpt
from . import distributed
from .config import DEFAULT_EPOCHS, DEFAULT_STEPS, TrainConfig, build_model, resolve_config
from .data import (TokenBatches, Tokenizer, collate, collate_packed, encode_pairs, load_corpus, make_task,
                   split_pairs, target_tokens, train_tokenizer)
from .data.batching import example_size
from .devices import backend_context, pick_device, pick_threads, resolve_dtype
from .translate import translate_lines


def autocast(cfg: TrainConfig, device: torch.device):
    """bf16 autocast on the run's device when the run's dtype resolves to bf16, else a no-op."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=resolve_dtype(cfg.dtype, device) == "bf16")


def load_data(cfg: TrainConfig) -> Tuple[List[Tuple[str, str]], List[Tuple[str, str]]]:
    """``(train_pairs, test_pairs)``: from ``--data`` (a held-out split) or the built-in task."""
    if cfg.data is not None:
        pairs = load_corpus(cfg.data, cfg.data_tgt)
        return split_pairs(pairs, cfg.test_fraction, cfg.seed)
    if cfg.data_tgt is not None:
        raise ValueError("--data-tgt needs --data SRC_FILE")
    return make_task(cfg.task, cfg.task_train, cfg.task_test, cfg.seed)


class _InterruptFlag:
    """Turns the first SIGINT (Ctrl-C) into a flag the loop checks between steps, so the
    checkpoint it then writes is consistent; a second Ctrl-C interrupts at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


class LossModule(torch.nn.Module):
    """``model.loss(src, tgt)`` as a module's forward, so DistributedDataParallel (which
    synchronises gradients of what its forward ran) can wrap the training loss."""

    def __init__(self, model: torch.nn.Module, label_smoothing: float):
        super().__init__()
        self.model = model
        self.label_smoothing = label_smoothing

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_segments: Optional[torch.Tensor] = None,
                tgt_segments: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.model.loss(src, tgt, label_smoothing=self.label_smoothing, src_segments=src_segments,
                               tgt_segments=tgt_segments)


def distributed_tokenizers(src_tok: Tokenizer, tgt_tok: Tokenizer) -> Tuple[Tokenizer, Tokenizer]:
    """Rank 0's tokenizers on every rank (broadcast), so all ranks encode the data alike."""
    import torch.distributed as dist

    both = [src_tok.to_dict(), tgt_tok.to_dict()]
    dist.broadcast_object_list(both, src=0)
    return Tokenizer.from_dict(both[0]), Tokenizer.from_dict(both[1])


class Trainer:
    """One training run: data, tokenizers, model, optimizer, schedule, and their checkpoints."""

    def __init__(self, cfg: TrainConfig, state: Optional[Dict[str, Any]] = None):
        from ..optim import NoamScheduler, make_optimizer

        self.cfg = cfg
        self.world = distributed.world_from_env()
        self.threads = pick_threads(cfg.threads, self.world.local_size)
        torch.set_num_threads(self.threads)
        self.device = distributed.init(self.world, pick_device(cfg.device))
        # validates --dtype before any work; the run (and its checkpoints) record the resolved one
        self.cfg = cfg = dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype, self.device))
        dims = cfg.model_dims()
        self.train_pairs, self.test_pairs = load_data(cfg)
        if state is None:
            kind = cfg.tokenizer_kind()
            self.src_tok = train_tokenizer(kind, (s for s, _ in self.train_pairs), cfg.vocab_size)
            self.tgt_tok = train_tokenizer(kind, (t for _, t in self.train_pairs), cfg.vocab_size)
        else:
            self.src_tok = Tokenizer.from_dict(state["src_tokenizer"])
            self.tgt_tok = Tokenizer.from_dict(state["tgt_tokenizer"])
        if self.world.distributed:  # every rank uses rank 0's tokenizers, whatever their training did
            self.src_tok, self.tgt_tok = distributed_tokenizers(self.src_tok, self.tgt_tok)
        self.examples = encode_pairs(self.train_pairs, self.src_tok, self.tgt_tok, cfg.max_len)
        self.batches = TokenBatches([example_size(e) for e in self.examples], cfg.batch_tokens, seed=cfg.seed,
                                    packed=cfg.pack)

        torch.manual_seed(cfg.seed)
        self.model = build_model(cfg, self.src_tok.vocab_size, self.tgt_tok.vocab_size).to(self.device)
        self.loss_module = LossModule(self.model, cfg.label_smoothing)
        if self.world.distributed:  # gradients all-reduced in buckets while backward runs
            from torch.nn.parallel import DistributedDataParallel

            self.loss_module = DistributedDataParallel(
                self.loss_module, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.optimizer = make_optimizer(self.model)
        self.scheduler = NoamScheduler(self.optimizer, dims["d_model"], cfg.warmup, factor=cfg.lr_factor)
        self.step, self.epoch, self.batch = 0, 0, 0
        self._updating = False
        self.history: List[float] = []
        self.rng = ckpt.rng_state()
        if state is not None:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.step = state["step"]
            self.epoch, self.batch = state["data_position"]
            self.history = list(state["history"])
            self.rng = state["rng"]
            ckpt.set_rng_state(self.rng)
        if cfg.steps is not None:
            self.total_steps = cfg.steps
        else:
            epochs = cfg.epochs if cfg.epochs is not None else (DEFAULT_EPOCHS if cfg.data else None)
            self.total_steps = epochs * len(self.batches) if epochs is not None else DEFAULT_STEPS
        self.path = ckpt.checkpoint_path(cfg.out)

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {
            "format": ckpt.FORMAT_VERSION,
            "config": dataclasses.asdict(self.cfg),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": self.rng,
            "step": self.step,
            "data_position": (self.epoch, self.batch),
            "history": list(self.history),
            "src_tokenizer": self.src_tok.to_dict(),
            "tgt_tokenizer": self.tgt_tok.to_dict(),
        }

    def save(self) -> Optional[str]:
        """Write a checkpoint (rank 0 only: the others return None)."""
        return ckpt.save(self.state_dict(), self.path) if self.world.is_main else None

    # -- training ----------------------------------------------------------------------------
    def train_step(self, src: torch.Tensor, tgt: torch.Tensor,
                   segments: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> float:
        """One optimizer update on a (global) batch; returns its loss, the mean over all its target
        tokens. ``segments``: the (source, target) segment ids of packed rows (``--pack``). With
        several processes each trains on its share of the rows (see
        :mod:`fastformer.jobs.distributed`), its loss weighted by its share of the target tokens."""
        weight = None
        if self.world.distributed:
            torch.manual_seed(distributed.step_seed(self.cfg.seed, self.step, self.world.rank))
            pad = self.model.pad_idx
            total = target_tokens(tgt, None if segments is None else segments[1], pad)
            rows, counts = distributed.shard_rows(src.shape[0], self.world)
            src, tgt = src[rows], tgt[rows]
            segments = None if segments is None else (segments[0][rows], segments[1][rows])
            mine = target_tokens(tgt, None if segments is None else segments[1], pad) if counts else 0
            weight = mine / total  # this rank's share of the batch's mean loss
        with autocast(self.cfg, self.device):
            loss = self.loss_module(src, tgt, *(segments or ()))
        if weight is not None:
            loss = loss * (weight * self.world.size)  # DDP averages: the ranks' sum is the batch mean
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.clip_norm and self.cfg.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_norm)
        self._updating = True  # until fit() has recorded the step: parameters and position disagree
        self.optimizer.step()
        self.scheduler.step()
        if weight is not None:
            import torch.distributed as dist

            total_loss = loss.detach().float() / self.world.size
            dist.all_reduce(total_loss)
            return float(total_loss)
        return float(loss.detach())

    def fit(self, on_step=None) -> List[float]:
        """Train up to ``total_steps``; returns the loss history (one value per step).

        The first Ctrl-C finishes the current step, saves a checkpoint and raises
        ``KeyboardInterrupt``. ``on_step(trainer)``, if given, runs after every step.
        """
        from tqdm import tqdm

        if self.step >= self.total_steps:
            return self.history
        self.model.train()
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (self.cfg.progress and self.world.is_main), mininterval=0.5, file=sys.stderr)
        tokens, t0, smooth = 0, time.perf_counter(), None
        stream = self.batches.iterate(self.epoch, self.batch)
        self._updating = False
        try:
            with backend_context(self.cfg.backend), _InterruptFlag() as interrupt:
                while self.step < self.total_steps:
                    epoch, b, indices = next(stream)
                    segments = None
                    if self.cfg.pack:
                        src, tgt, *segments = collate_packed(self.examples, indices)
                        segments = tuple(t.to(self.device) for t in segments)
                    else:
                        src, tgt = collate(self.examples, indices)
                    ntok = int((src != 0).sum() + (tgt != 0).sum())
                    src, tgt = src.to(self.device), tgt.to(self.device)
                    loss = self.train_step(src, tgt, segments)
                    self.step += 1
                    self.epoch, self.batch = epoch, b + 1
                    self.history.append(loss)
                    self.rng = ckpt.rng_state()
                    self._updating = False
                    if not math.isfinite(loss):  # the last saved checkpoint (before this) is kept
                        raise FloatingPointError(f"the loss is {loss} at step {self.step}; try a lower "
                                                 "--lr-factor, a longer --warmup or --clip-norm")
                    tokens += ntok
                    smooth = loss if smooth is None else 0.95 * smooth + 0.05 * loss
                    elapsed = time.perf_counter() - t0
                    bar.set_postfix(loss=f"{smooth:.3f}", tok_s=f"{tokens / max(elapsed, 1e-9):,.0f}",
                                    lr=f"{self.scheduler.get_last_lr()[0]:.2e}", refresh=False)
                    bar.update(1)
                    if on_step is not None:
                        on_step(self)
                    if interrupt.requested:
                        raise KeyboardInterrupt
                    if self.cfg.save_every and self.step % self.cfg.save_every == 0:
                        self.save()
        except KeyboardInterrupt:
            bar.close()
            if not self._updating and self.world.is_main:  # the state of the last step is intact
                path = self.save()
                print(f"\ninterrupted: checkpoint of step {self.step} saved to {path} "
                      f"(continue with --resume --out {self.cfg.out})", file=sys.stderr)
            elif self.world.is_main:
                print("\ninterrupted during a parameter update; the last saved checkpoint is kept",
                      file=sys.stderr)
            raise
        bar.close()
        self.save()
        return self.history

    # -- evaluation --------------------------------------------------------------------------
    def translate(self, sources: Sequence[str], beam: int = 1) -> List[str]:
        return translate_lines(self.model, self.src_tok, self.tgt_tok, sources, beam=beam,
                               batch_size=self.cfg.eval_batch, max_len=self.cfg.max_len, device=self.device,
                               backend=self.cfg.backend)

    def evaluate(self) -> Dict[str, Any]:
        """Exact match (%) and BLEU of the held-out split, with a few example translations."""
        import sacrebleu

        sources = [s for s, _ in self.test_pairs]
        refs = [t for _, t in self.test_pairs]
        t0 = time.perf_counter()
        hyps = self.translate(sources, beam=self.cfg.beam)
        seconds = time.perf_counter() - t0
        exact = sum(h.strip() == r.strip() for h, r in zip(hyps, refs)) / len(refs)
        bleu = sacrebleu.corpus_bleu(hyps, [refs]).score
        shown = [{"source": s, "hypothesis": h, "reference": r}
                 for s, h, r in list(zip(sources, hyps, refs))[: self.cfg.examples]]
        return {"exact_match": 100.0 * exact, "bleu": bleu, "n_test": len(refs),
                "translate_seconds": seconds, "examples": shown}


def run(options: Dict[str, Any], resume: bool = False) -> Dict[str, Any]:
    """Train (or resume) with ``options`` (TrainConfig field -> value, only those the user set),
    evaluate, write ``results.json`` next to the checkpoint and print the summary."""
    out = options.get("out", TrainConfig.out)
    state = None
    if resume:
        state = ckpt.load(out)
        cfg = resolve_config(options, state["config"])
    else:
        cfg = resolve_config(options)
    started = time.perf_counter()
    trainer = Trainer(cfg, state)
    setup_seconds = time.perf_counter() - started
    dims = cfg.model_dims()
    n_params = sum(p.numel() for p in trainer.model.parameters())
    what = f"--data {cfg.data}" if cfg.data else f"task {cfg.task!r}"
    say = print if trainer.world.is_main else (lambda *a, **k: None)
    say(f"fastformer train: {what}: {len(trainer.train_pairs)} training pairs, {len(trainer.test_pairs)} "
          f"held out; {cfg.tokenizer_kind()} tokenizer (vocab {trainer.src_tok.vocab_size} src / "
          f"{trainer.tgt_tok.vocab_size} tgt); model d={dims['d_model']} h={dims['heads']} "
          f"L={dims['layers']}+{dims['layers']} ffn={dims['ffn']} dropout={cfg.dropout_p()} "
          f"({n_params / 1e6:.2f}M params); "
          f"{trainer.total_steps} steps on {trainer.device} ({trainer.cfg.dtype}, backend {cfg.backend}, "
          f"{trainer.threads} threads"
          + (f" per process, {trainer.world.size} processes" if trainer.world.distributed else "") + ")"
          + (f"; resuming at step {trainer.step}" if state is not None else ""))
    sys.stdout.flush()
    try:
        history = trainer.fit()
    finally:
        if not trainer.world.is_main:  # only rank 0 evaluates, writes and prints
            distributed.shutdown(trainer.world)
    if not trainer.world.is_main:
        return {}
    train_seconds = time.perf_counter() - started - setup_seconds
    metrics = trainer.evaluate()
    metrics.update(steps=trainer.step, final_loss=history[-1] if history else None, setup_seconds=setup_seconds,
                   train_seconds=train_seconds, total_seconds=time.perf_counter() - started,
                   checkpoint=trainer.path)
    _write_json(os.path.join(os.path.dirname(trainer.path), "results.json"), metrics)
    print(f"held-out exact match {metrics['exact_match']:.1f}% | BLEU {metrics['bleu']:.1f} | "
          f"{metrics['n_test']} pairs | {trainer.step} steps | data+setup {setup_seconds:.0f}s, training "
          f"{train_seconds:.0f}s, evaluation {metrics['translate_seconds']:.0f}s, total "
          f"{metrics['total_seconds']:.0f}s | checkpoint {trainer.path}")
    for ex in metrics["examples"]:
        mark = "ok " if ex["hypothesis"].strip() == ex["reference"].strip() else "BAD"
        print(f"  [{mark}] {ex['source']!r} -> {ex['hypothesis']!r} (reference {ex['reference']!r})")
    distributed.shutdown(trainer.world)
    return metrics


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)
