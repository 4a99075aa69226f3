"""The command line: ``python -m fastformer train | translate | bench | check`` (console script
``fastformer``): the argument parsers of the jobs, and :func:`main`, which runs the one asked for."""
import argparse
import os
import sys
from typing import List, Optional

from ..backends import CHOICES as BACKEND_CHOICES
from .devices import THREADS_HELP

S = argparse.SUPPRESS  # options left out stay out, so a resumed run can tell what the user changed


def _train_parser(sub) -> None:
    from .config import PRESETS, TrainConfig as C
    from .data.tasks import TASKS

    p = sub.add_parser("train", help="train a Seq2SeqTransformer (default: the built-in dates task)",
                       description="Train a Seq2SeqTransformer, checkpoint it, and report exact match and "
                                   "BLEU on a held-out split. With no options: the built-in 'dates' task.",
                       argument_default=S)
    d = p.add_argument_group("data")
    d.add_argument("--task", choices=sorted(TASKS), help=f"built-in task (default {C.task})")
    d.add_argument("--task-train", type=int, metavar="N", help=f"training pairs generated (default {C.task_train})")
    d.add_argument("--task-test", type=int, metavar="N", help=f"held-out pairs generated (default {C.task_test})")
    d.add_argument("--data", metavar="PATH", help="TSV file of 'source<TAB>target' lines, or with --data-tgt "
                                                  "the source side of two aligned files")
    d.add_argument("--data-tgt", metavar="PATH", help="target-side file aligned line by line with --data")
    d.add_argument("--test-fraction", type=float, help=f"share of --data sources held out (default {C.test_fraction})")
    d.add_argument("--tokenizer", choices=["auto", "char", "bpe"],
                   help="auto (default): char for the built-in task, BPE for --data")
    d.add_argument("--vocab-size", type=int, help=f"BPE vocabulary size per side (default {C.vocab_size})")
    d.add_argument("--max-len", type=int, help=f"longest sequence kept, in tokens (default {C.max_len})")
    m = p.add_argument_group("model")
    m.add_argument("--preset", choices=sorted(PRESETS),
                   help=f"model size (default {C.preset}); base = the paper's 512/8/6/2048")
    m.add_argument("--d-model", type=int, help="model width (overrides the preset)")
    m.add_argument("--heads", type=int, help="attention heads (overrides the preset)")
    m.add_argument("--layers", type=int, help="encoder and decoder layers each (overrides the preset)")
    m.add_argument("--ffn", type=int, help="feed-forward width (overrides the preset)")
    m.add_argument("--dropout", type=float,
                   help="dropout probability (default 0 for the built-in tasks, 0.1 for --data)")
    m.add_argument("--norm-first", action="store_true", help="pre-LN layers instead of the paper's post-LN")
    o = p.add_argument_group("optimisation")
    o.add_argument("--batch-tokens", type=int, help=f"padded tokens per batch, length-bucketed (default {C.batch_tokens})")
    o.add_argument("--pack", action="store_true", default=None,
                   help="several sentence pairs a row, in random order (no length bucketing); --batch-tokens "
                        "then counts real tokens")
    o.add_argument("--warmup", type=int, help=f"Noam warm-up steps (default {C.warmup})")
    o.add_argument("--lr-factor", type=float, help=f"Noam schedule factor (default {C.lr_factor})")
    o.add_argument("--label-smoothing", type=float, help=f"(default {C.label_smoothing})")
    o.add_argument("--clip-norm", type=float, help=f"gradient norm clip, 0 = off (default {C.clip_norm})")
    o.add_argument("--epochs", type=int, help="passes over the training data")
    o.add_argument("--steps", type=int, help="optimizer steps (default: tuned for the built-in task, "
                                             "or 10 epochs for --data)")
    x = p.add_argument_group("execution")
    x.add_argument("--backend", choices=BACKEND_CHOICES,
                   help="fastformer kernel backend (default auto)")
    x.add_argument("--dtype", choices=["auto", "fp32", "bf16"],
                   help="bf16 = torch.autocast to bfloat16; auto (default) = bf16 on a CUDA GPU, fp32 on a CPU")
    x.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default auto: cuda if available")
    x.add_argument("--threads", type=int, help=THREADS_HELP)
    x.add_argument("--seed", type=int, help=f"seeds the data, split, order, init and dropout (default {C.seed})")
    x.add_argument("--out", metavar="DIR", help=f"checkpoint directory (default {C.out})")
    x.add_argument("--save-every", type=int, metavar="STEPS", help=f"checkpoint period (default {C.save_every})")
    x.add_argument("--resume", action="store_true", default=False, help="continue from DIR's last checkpoint")
    x.add_argument("--nproc", type=int, metavar="N",
                   help="train with N processes on this machine (DistributedDataParallel: gloo on CPU, nccl "
                        "on GPUs): launches `torchrun --standalone --nproc_per_node N -m fastformer train ...`. "
                        "Under torchrun itself, leave it out")
    x.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm progress bar")
    e = p.add_argument_group("evaluation")
    e.add_argument("--beam", type=int, help="beam size for the held-out translations (default 1 = greedy)")
    e.add_argument("--examples", type=int, help=f"example translations printed (default {C.examples})")


def _translate_parser(sub) -> None:
    p = sub.add_parser("translate", help="translate stdin lines with a trained checkpoint",
                       description="Translate lines from stdin to stdout, one output line per input line.")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a train --out directory or checkpoint file")
    p.add_argument("--beam", type=int, default=1, help="beam size (default 1 = greedy)")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per generate() call (default 64)")
    p.add_argument("--max-len", type=int, default=None, metavar="N",
                   help="longest output in tokens, <s> included (default: source length + 50)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--backend", choices=BACKEND_CHOICES, default="auto")


def _bench_parser(sub) -> None:
    from .bench import add_arguments

    p = sub.add_parser("bench", help="benchmark every op and the training step against torch",
                       description="Time fastformer's ops (forward, backward, forward+backward) and the "
                                   "end-to-end training step against eager PyTorch and torch.compile.")
    add_arguments(p)


def _check_parser(sub) -> None:
    from .check import add_arguments

    p = sub.add_parser("check", help="check every op on every kernel backend here against the reference",
                       description="List the backends (and why any is unavailable), then run every op forward "
                                   "and backward on each kernel backend that can run here, in fp32 and bf16 "
                                   "(and fp16 on CUDA), against fastformer.ops.reference. Exits 1 on any failure.")
    add_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastformer", description="fastformer: fused-kernel Transformer training")
    sub = parser.add_subparsers(dest="command", metavar="{train,translate,bench,check}")
    sub.required = True
    _train_parser(sub)
    _translate_parser(sub)
    _bench_parser(sub)
    _check_parser(sub)
    return parser


def _without_nproc(argv: List[str]) -> List[str]:
    """``argv`` without its ``--nproc N`` / ``--nproc=N``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = dict(vars(args))
    command = options.pop("command")
    try:
        if command == "train":
            from . import train

            resume = options.pop("resume")
            nproc = options.pop("nproc", None)
            if nproc is not None and "WORLD_SIZE" not in os.environ:
                from . import distributed

                rest = _without_nproc(list(sys.argv[1:] if argv is None else argv))
                rest.remove("train")  # the subcommand: torchrun's command line names it itself
                return distributed.launch(nproc, rest)
            if nproc is not None and int(os.environ["WORLD_SIZE"]) != nproc:
                raise ValueError(f"--nproc {nproc} under torchrun with WORLD_SIZE={os.environ['WORLD_SIZE']}: "
                                 "leave --nproc out under torchrun")
            train.run(options, resume=resume)
        elif command == "translate":
            from . import translate

            translate.run(options["checkpoint"], beam=options["beam"], batch_size=options["batch_size"],
                          device=options["device"], backend=options["backend"], max_output_len=options["max_len"])
        elif command == "check":
            from . import check

            return 1 if check.run(options["backends"], options["ops"], autotune=options["autotune"]) else 0
        else:
            from . import bench

            bench.run_from_args(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"fastformer {command}: error: {e}", file=sys.stderr)
        return 2
    return 0
