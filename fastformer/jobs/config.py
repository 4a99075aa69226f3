"""The training run's configuration: :class:`TrainConfig` (every option of
``python -m fastformer train``, saved in each checkpoint), the model-size presets, the merge of
the user's options with a checkpoint's on resume, and the model a config describes."""
import dataclasses
from typing import Any, Dict, Optional

from .. import backends
from .devices import DTYPES

PRESETS: Dict[str, Dict[str, int]] = {
    "tiny": dict(d_model=128, heads=4, layers=2, ffn=512),
    "small": dict(d_model=256, heads=4, layers=3, ffn=1024),
    "base": dict(d_model=512, heads=8, layers=6, ffn=2048),  # the paper's base model
}


@dataclasses.dataclass
class TrainConfig:
    """Everything that defines a training run (saved in its checkpoints)."""
    # data
    task: str = "dates"
    task_train: int = 60000
    task_test: int = 1000
    data: Optional[str] = None
    data_tgt: Optional[str] = None
    test_fraction: float = 0.05
    tokenizer: str = "auto"  # char for the built-in tasks, bpe for --data
    vocab_size: int = 8000
    max_len: int = 256
    # model
    preset: str = "tiny"
    d_model: Optional[int] = None
    heads: Optional[int] = None
    layers: Optional[int] = None
    ffn: Optional[int] = None
    dropout: Optional[float] = None  # 0 for the built-in tasks, the paper's 0.1 for --data
    norm_first: bool = False
    # optimisation
    batch_tokens: int = 1024
    pack: bool = False  # several sentence pairs a row (see collate_packed)
    warmup: int = 200
    lr_factor: float = 0.3
    label_smoothing: float = 0.1
    clip_norm: float = 1.0
    epochs: Optional[int] = None
    steps: Optional[int] = None
    # execution
    backend: str = "auto"
    dtype: str = "auto"  # auto: bf16 autocast on a CUDA GPU with bf16, fp32 elsewhere
    device: str = "auto"
    threads: Optional[int] = None  # torch intra-op threads (default: see pick_threads)
    seed: int = 0
    out: str = "runs/fastformer"
    save_every: int = 500
    # evaluation
    beam: int = 1
    eval_batch: int = 250
    examples: int = 5
    progress: bool = True

    def validate(self) -> "TrainConfig":
        """Every option in its range, checked before any work; a ValueError names the flag."""
        from .data.tasks import TASKS

        def flag(name: str) -> str:
            return "--" + name.replace("_", "-")

        def at_least(name: str, minimum: int, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{flag(name)} must be an integer >= {minimum}, got {value!r}")

        def in_range(name: str, lo: float, hi: float, hi_open: bool, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= value and (
                value < hi if hi_open else value <= hi)
            if not ok:
                raise ValueError(f"{flag(name)} must be a number in [{lo:g}, {hi:g}{')' if hi_open else ']'}, "
                                 f"got {value!r}")

        def one_of(name: str, choices) -> None:
            if getattr(self, name) not in choices:
                raise ValueError(f"{flag(name)} must be one of {sorted(choices)}, got {getattr(self, name)!r}")

        one_of("task", TASKS)
        one_of("tokenizer", ("auto", "char", "bpe"))
        one_of("preset", PRESETS)
        one_of("backend", backends.CHOICES)
        one_of("dtype", DTYPES)
        one_of("device", ("auto", "cpu", "cuda"))
        for name in ("task_train", "task_test", "batch_tokens", "warmup", "beam", "eval_batch"):
            at_least(name, 1)
        at_least("vocab_size", 4)  # BPE needs its specials and at least one symbol
        at_least("max_len", 2)  # a token and eos
        for name in ("d_model", "heads", "layers", "ffn", "epochs", "threads"):
            at_least(name, 1, optional=True)
        for name in ("steps", "save_every", "examples"):  # --steps 0 evaluates only, --save-every 0 = at the end
            at_least(name, 0, optional=name == "steps")
        at_least("seed", 0)
        in_range("test_fraction", 0.0, 1.0, hi_open=True)
        if self.data is not None and self.test_fraction <= 0.0:
            raise ValueError(f"--test-fraction must be > 0 (a held-out split), got {self.test_fraction!r}")
        in_range("dropout", 0.0, 1.0, hi_open=True, optional=True)
        in_range("label_smoothing", 0.0, 1.0, hi_open=False)
        in_range("lr_factor", 0.0, float("inf"), hi_open=True)
        if self.lr_factor <= 0.0:
            raise ValueError(f"--lr-factor must be > 0, got {self.lr_factor!r}")
        in_range("clip_norm", 0.0, float("inf"), hi_open=True)
        self.model_dims()  # d_model divisible by heads
        return self

    def model_dims(self) -> Dict[str, int]:
        """d_model / heads / layers / ffn: the preset, with explicit options taking precedence."""
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        dims = dict(PRESETS[self.preset])
        for key in dims:
            value = getattr(self, key)
            if value is not None:
                dims[key] = value
        if dims["d_model"] % dims["heads"]:
            raise ValueError(f"--d-model ({dims['d_model']}) must be divisible by --heads ({dims['heads']})")
        return dims

    def dropout_p(self) -> float:
        """The dropout probability: as given, else 0.0 for a built-in task (a short run over
        ~1.5 epochs of fresh pairs underfits; dropout only slows it) and 0.1 for ``--data``."""
        if self.dropout is not None:
            return self.dropout
        return 0.1 if self.data else 0.0

    def tokenizer_kind(self) -> str:
        if self.tokenizer == "auto":
            return "bpe" if self.data else "char"
        return self.tokenizer


# Options a resumed run may change; every other one must match the checkpoint's.
RESUMABLE = {"steps", "epochs", "backend", "device", "threads", "out", "save_every", "beam", "eval_batch",
             "examples", "progress"}
DEFAULT_STEPS = 2000  # built-in task, when neither --steps nor --epochs is given
DEFAULT_EPOCHS = 10  # --data, when neither --steps nor --epochs is given


def resolve_config(options: Dict[str, Any], saved: Optional[Dict[str, Any]] = None) -> TrainConfig:
    """The config of a run from the options the user gave (and the checkpoint's, on resume)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(options) - names
    if unknown:
        raise ValueError(f"unknown training options: {sorted(unknown)}")
    if saved is None:
        return TrainConfig(**options).validate()
    merged = dict(saved)
    for key, value in options.items():
        if key in RESUMABLE:
            merged[key] = value
        elif saved.get(key) != value:
            raise ValueError(f"--{key.replace('_', '-')} is {value!r} but the checkpoint was trained with "
                             f"{saved.get(key)!r}; a resumed run keeps it (drop the option)")
    return TrainConfig(**{k: v for k, v in merged.items() if k in names}).validate()


def build_model(cfg: TrainConfig, src_vocab: int, tgt_vocab: int):
    """The Seq2SeqTransformer a config describes (pad/bos/eos = the tokenizers' 0/1/2)."""
    from ..models import Seq2SeqTransformer

    dims = cfg.model_dims()
    return Seq2SeqTransformer(src_vocab, tgt_vocab, d_model=dims["d_model"], nhead=dims["heads"],
                              num_encoder_layers=dims["layers"], num_decoder_layers=dims["layers"],
                              dim_feedforward=dims["ffn"], dropout=cfg.dropout_p(), norm_first=cfg.norm_first,
                              max_len=cfg.max_len + 64)

