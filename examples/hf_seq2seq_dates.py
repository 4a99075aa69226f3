"""Train a small Hugging Face seq2seq model with transformers' Seq2SeqTrainer on fastformer's built-in
dates task ("the 21st of March, 1999" -> "1999-03-21"), twice: plain, and after
``fastformer.convert(model, label_smoothing=0.1)``; report the time per training step, and exact
match and BLEU on held-out dates, of each::

    python examples/hf_seq2seq_dates.py                    # Marian; a few minutes on a 2-core CPU
    python examples/hf_seq2seq_dates.py --model t5         # T5 v1.1-shaped
    python examples/hf_seq2seq_dates.py --quick            # a minute or two
    python examples/hf_seq2seq_dates.py --steps 3000 --threads 4 --out marian_dates.json
    python examples/hf_seq2seq_dates.py --only-fastformer  # (or --no-fastformer) one run only

Needs transformers, tokenizers and sacrebleu (``pip install transformers accelerate tokenizers
sacrebleu``); nothing is downloaded: the model is built from a config and the vocabulary is a
byte-level BPE trained on the task's own pairs with ``tokenizers``. The model families (``--model``):

* ``marian`` (default): a ``MarianMTModel`` from a ``MarianConfig`` in OPUS-MT's layout: post-LN,
  swish activation, scaled sinusoidal embeddings shared by both sides and the output layer; the
  vocabulary's specials at fastformer's ids (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2, ``<unk>`` 3).
* ``t5``: a ``T5ForConditionalGeneration`` from a ``T5Config`` in T5 v1.1's layout: RMSNorm pre-norm,
  gated-gelu feed-forward, a learned relative position bias, no biases, an output layer untied from
  the embeddings; the specials at T5's ids (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2; no ``<s>``).

Both take the source as "text </s>" and the labels as "text </s>", and start the decoder from
``<pad>``; each family is a :class:`Family` (config, special ids, vocabulary, collate), the rest is
shared.

Both runs optimise the same objective, cross-entropy with label smoothing 0.1 over the non-pad
target tokens: the converted model computes it in fastformer's fused LM-head loss (the logits are
never materialised); the plain run computes it from the model's logits with
``F.cross_entropy(..., label_smoothing=0.1)`` (``compute_loss_func``), which is what the Trainer's
own ``label_smoothing_factor=0.1`` computes. ``label_smoothing_factor`` stays 0 in both: with it
set, the Trainer takes the labels away from the model, and a converted model then cannot fuse its
loss. Both start from the same initial weights and see the same batches in the same order.

The time per step is measured by a ``TrainerCallback`` from ``on_step_begin`` to ``on_step_end``
(forward, backward, gradient clipping and the optimizer step; not the data loading), median over the
steps after a warm-up. Nothing is saved unless ``--out`` names a JSON file.
"""
import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from fastformer.jobs.data import EOS_ID, PAD_ID

Pair = Tuple[str, str]
IGNORE = -100

# (d_model, layers per side, heads, FFN, batch, steps, training pairs, held-out pairs, learning rate):
# both families' defaults
FULL = dict(d_model=256, layers=3, heads=4, ffn=1024, batch_size=64, steps=1200, train_pairs=40000,
            test_pairs=500, lr=1e-3, vocab_size=1000)
QUICK = dict(d_model=128, layers=2, heads=4, ffn=512, batch_size=32, steps=300, train_pairs=10000,
             test_pairs=200, lr=2e-3, vocab_size=600)


# -- the model families ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """What differs between model families; training, evaluation, timing and the report are shared."""
    name: str                               # the --model choice
    title: str                              # the report's name of the model
    pad_id: int                             # also the decoder's start token (both families)
    eos_id: int
    vocabulary: Callable                    # (texts, vocab_size) -> tokenizer: vocab_size, encode, decode
    build_config: Callable                  # (args, vocab_size) -> the transformers config
    build_model: Callable                   # config -> the model, freshly initialised
    layers: Callable                        # model -> its Transformer layers (encoder's, then decoder's)
    activation: str                         # the default --activation

    def collate(self, examples: List[Dict]) -> Dict[str, torch.Tensor]:
        return collate(examples, self.pad_id)


def marian_vocabulary(texts: List[str], vocab_size: int):
    from fastformer.jobs.data import BPETokenizer

    return BPETokenizer.train(texts, vocab_size=vocab_size)


def marian_config(args, vocab_size: int):
    from transformers import MarianConfig

    return MarianConfig(
        vocab_size=vocab_size, decoder_vocab_size=vocab_size, d_model=args.d_model,
        encoder_layers=args.layers, decoder_layers=args.layers,
        encoder_attention_heads=args.heads, decoder_attention_heads=args.heads,
        encoder_ffn_dim=args.ffn, decoder_ffn_dim=args.ffn, activation_function=args.activation,
        dropout=args.dropout, attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=128,
        scale_embedding=True, share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
        pad_token_id=PAD_ID, eos_token_id=EOS_ID, decoder_start_token_id=PAD_ID,
        # from scratch: weights ~ N(0, 1/d_model) (transformers' 0.02 suits fine-tuning; here it leaves the
        # decoder ignoring the source for hundreds of steps)
        init_std=args.d_model ** -0.5,
        use_cache=False)  # training: no key/value cache (the plain run's forward gets no labels to say so)


def marian_model(config):
    from transformers import MarianMTModel

    return MarianMTModel(config)


T5_PAD_ID, T5_EOS_ID, T5_UNK_ID = 0, 1, 2
T5_SPECIALS = ("<pad>", "</s>", "<unk>")


class T5Vocabulary:
    """A byte-level BPE trained with ``tokenizers`` as fastformer's ``BPETokenizer`` trains Marian's,
    with the specials at T5's ids: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2 (T5 has no ``<s>``)."""

    def __init__(self, texts: List[str], vocab_size: int):
        from fastformer.jobs.data.tokenizer import train_byte_level_bpe

        tok = train_byte_level_bpe(texts, vocab_size, T5_SPECIALS)
        got = [tok.token_to_id(name) for name in T5_SPECIALS]
        if got != [T5_PAD_ID, T5_EOS_ID, T5_UNK_ID]:  # tokenizers places the specials first, in order
            raise RuntimeError(f"the T5 vocabulary put {T5_SPECIALS} at {got}, not T5's ids 0, 1, 2")
        self._tok = tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text up to the first ``</s>``, without ``<pad>``."""
        ids = [int(i) for i in ids]
        if T5_EOS_ID in ids:
            ids = ids[:ids.index(T5_EOS_ID)]
        return self._tok.decode(ids, skip_special_tokens=True)


def t5_config(args, vocab_size: int):
    from transformers import T5Config

    return T5Config(
        vocab_size=vocab_size, d_model=args.d_model, d_kv=args.d_model // args.heads, d_ff=args.ffn,
        num_layers=args.layers, num_decoder_layers=args.layers, num_heads=args.heads,
        feed_forward_proj=args.activation,  # v1.1: gated-gelu (v1.0 had relu)
        relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=args.dropout,
        tie_word_embeddings=False,  # v1.1: the output layer has its own weights (and no d_model**-0.5 scaling)
        pad_token_id=T5_PAD_ID, eos_token_id=T5_EOS_ID, decoder_start_token_id=T5_PAD_ID,
        use_cache=False)  # training: no key/value cache (the plain run's forward gets no labels to say so)


def t5_model(config):
    from transformers import T5ForConditionalGeneration

    from fastformer.hf.t5 import untie_lm_head

    model = T5ForConditionalGeneration(config)
    untie_lm_head(model)  # v1.1's own output layer (transformers 5 ties a config-built T5's regardless)
    return model


FAMILIES = {
    "marian": Family("marian", "MarianMTModel", pad_id=PAD_ID, eos_id=EOS_ID, vocabulary=marian_vocabulary,
                     build_config=marian_config, build_model=marian_model,
                     layers=lambda m: list(m.model.encoder.layers) + list(m.model.decoder.layers),
                     activation="swish"),
    "t5": Family("t5", "T5ForConditionalGeneration (v1.1-shaped)", pad_id=T5_PAD_ID, eos_id=T5_EOS_ID,
                 vocabulary=T5Vocabulary, build_config=t5_config, build_model=t5_model,
                 layers=lambda m: list(m.encoder.block) + list(m.decoder.block), activation="gated-gelu"),
}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=sorted(FAMILIES), default="marian",
                   help="the model family (default marian; t5: T5 v1.1-shaped)")
    p.add_argument("--quick", action="store_true",
                   help="a smaller model and a short run (a minute or two on a 2-core CPU)")
    p.add_argument("--steps", type=int, help=f"training steps per run (default {FULL['steps']}, "
                                             f"{QUICK['steps']} with --quick)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own choice)")
    one = p.add_mutually_exclusive_group()
    one.add_argument("--no-fastformer", action="store_true", help="only the plain transformers run")
    one.add_argument("--only-fastformer", action="store_true", help="only the fastformer.convert run")
    p.add_argument("--out", metavar="FILE.json", help="write the report as JSON here (default: nothing saved)")
    m = p.add_argument_group("model and data (defaults depend on --model and --quick)")
    m.add_argument("--d-model", type=int)
    m.add_argument("--layers", type=int, help="encoder layers = decoder layers")
    m.add_argument("--heads", type=int, help="attention heads (T5: d_kv = d_model / heads)")
    m.add_argument("--ffn", type=int, help="feed-forward width")
    m.add_argument("--activation", help="the activation: transformers' name for Marian (default swish, as "
                                        "OPUS-MT), feed_forward_proj for T5 (default gated-gelu, as v1.1)")
    m.add_argument("--vocab-size", type=int, help="BPE vocabulary size (both sides share it)")
    m.add_argument("--batch-size", type=int)
    m.add_argument("--lr", type=float, help="peak learning rate (linear warm-up over 10%% of the steps, "
                                            "then linear decay)")
    m.add_argument("--train-pairs", type=int)
    m.add_argument("--test-pairs", type=int)
    m.add_argument("--dropout", type=float, default=0.1)
    m.add_argument("--label-smoothing", type=float, default=0.1)
    m.add_argument("--timing-warmup", type=int, help="steps left out of the step time (default: the first "
                                                     "10%%, at least 3)")
    m.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for key, value in dict(QUICK if args.quick else FULL, activation=FAMILIES[args.model].activation).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    if args.timing_warmup is None:
        args.timing_warmup = min(max(3, args.steps // 10), args.steps - 1)
    return args


# -- data: fastformer's built-in task, a BPE vocabulary trained on it ------------------------------
def make_data(args, family: Family) -> Tuple[object, List[Dict], List[Pair]]:
    """The tokenizer, the encoded training examples and the held-out pairs."""
    from fastformer.jobs.data import make_task

    train_pairs, test_pairs = make_task("dates", n_train=args.train_pairs, n_test=args.test_pairs, seed=args.seed)
    # one vocabulary for both sides (Marian shares the embeddings of encoder, decoder and output layer)
    tok = family.vocabulary([s for s, _ in train_pairs] + [t for _, t in train_pairs], args.vocab_size)
    # source "text </s>", labels "text </s>"; the decoder starts from <pad>
    examples = [{"input_ids": tok.encode(s)[:126] + [family.eos_id], "labels": tok.encode(t)[:126] + [family.eos_id]}
                for s, t in train_pairs]
    return tok, examples, test_pairs


def collate(examples: List[Dict], pad_id: int) -> Dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask``, ``labels`` padded with -100 and the
    ``decoder_input_ids`` the model would shift from them (``<pad>`` first, as Marian and T5 do):
    given here because the plain run's loss takes the labels away from the model."""
    B = len(examples)
    Ls = max(len(e["input_ids"]) for e in examples)
    Lt = max(len(e["labels"]) for e in examples)
    input_ids = torch.full((B, Ls), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, Ls), dtype=torch.long)
    labels = torch.full((B, Lt), IGNORE, dtype=torch.long)
    decoder_input_ids = torch.full((B, Lt), pad_id, dtype=torch.long)
    for i, e in enumerate(examples):
        s, t = e["input_ids"], e["labels"]
        input_ids[i, :len(s)] = torch.tensor(s)
        attention_mask[i, :len(s)] = 1
        labels[i, :len(t)] = torch.tensor(t)
        decoder_input_ids[i, 1:len(t)] = torch.tensor(t[:-1])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
            "decoder_input_ids": decoder_input_ids}


# -- the model -------------------------------------------------------------------------------------
def build_model(args, family: Family, vocab_size: int):
    from transformers import GenerationConfig, set_seed

    config = family.build_config(args, vocab_size)
    set_seed(args.seed)  # the same initial weights for both runs
    model = family.build_model(config)
    pad, eos = family.pad_id, family.eos_id
    model.generation_config = GenerationConfig(
        decoder_start_token_id=pad, eos_token_id=eos, pad_token_id=pad, bad_words_ids=[[pad]],
        num_beams=1, do_sample=False, max_new_tokens=24, use_cache=True)
    return model


def fusion_summary(model, family: Family) -> Dict:
    """What ``fastformer.convert`` did to the model: its attention implementation, how many of its
    Transformer layers run fastformer's fused forward, and whether its training loss is fastformer's."""
    def fastformers(obj) -> bool:
        return type(obj).__module__.startswith("fastformer")

    layers = family.layers(model)
    return {"attn_implementation": getattr(model.config, "_attn_implementation", None),
            "fused_layers": sum(map(fastformers, layers)), "transformer_layers": len(layers),
            "fused_loss": fastformers(model)}


# -- training --------------------------------------------------------------------------------------
def step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Seconds of each optimizer step: from ``on_step_begin`` (the batch is already loaded) to
        ``on_step_end`` (after the optimizer step), and the loss the Trainer logged."""

        def __init__(self):
            self.seconds: List[float] = []
            self.losses: List[float] = []
            self._t0 = None

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self._t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    return StepTimer()


def smoothed_loss(smoothing: float):
    """The plain run's loss: ``F.cross_entropy`` with label smoothing from the model's logits (what
    ``label_smoothing_factor`` computes), over the non-pad (``labels != -100``) tokens."""
    def loss(outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                               ignore_index=IGNORE, label_smoothing=smoothing)
    return loss


def train(args, family: Family, model, examples: List[Dict], fused: bool, workdir: str) -> Dict:
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    targs = Seq2SeqTrainingArguments(
        output_dir=workdir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="linear", warmup_steps=max(1, args.steps // 10),
        weight_decay=0.0, adam_beta2=0.98, max_grad_norm=1.0, gradient_accumulation_steps=1,
        label_smoothing_factor=0.0,  # the smoothing is in the loss of each run (see the docstring)
        save_strategy="no", eval_strategy="no", report_to="none", push_to_hub=False,
        logging_strategy="steps", logging_steps=max(1, args.steps // 10), disable_tqdm=True,
        dataloader_num_workers=0, dataloader_pin_memory=torch.cuda.is_available(), seed=args.seed,
        data_seed=args.seed)
    timer = step_timer()
    trainer = Seq2SeqTrainer(model=model, args=targs, train_dataset=examples, data_collator=family.collate,
                             compute_loss_func=None if fused else smoothed_loss(args.label_smoothing),
                             callbacks=[timer])
    out = trainer.train()
    timed = timer.seconds[args.timing_warmup:] or timer.seconds
    return {"steps": len(timer.seconds), "timed_steps": len(timed),
            "step_ms_median": 1e3 * statistics.median(timed), "step_ms_mean": 1e3 * statistics.fmean(timed),
            "step_ms_min": 1e3 * min(timed), "train_runtime_s": out.metrics.get("train_runtime"),
            "train_loss": out.metrics.get("train_loss"), "logged_losses": timer.losses}


# -- evaluation ------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, family: Family, tok, pairs: List[Pair], batch_size: int = 100) -> Dict:
    """Greedy ``generate()`` of the held-out sources: exact match (a fraction in [0, 1]) and BLEU."""
    import sacrebleu

    model.eval()
    device = next(model.parameters()).device
    hyps: List[str] = []
    t0 = time.perf_counter()
    for i in range(0, len(pairs), batch_size):
        ids = [tok.encode(s)[:126] + [family.eos_id] for s, _ in pairs[i:i + batch_size]]
        L = max(map(len, ids))
        input_ids = torch.tensor([x + [family.pad_id] * (L - len(x)) for x in ids], device=device)
        out = model.generate(input_ids=input_ids, attention_mask=(input_ids != family.pad_id).long())
        hyps += [tok.decode(row.tolist()).strip() for row in out]
    refs = [t for _, t in pairs]
    exact = sum(h == r for h, r in zip(hyps, refs)) / len(refs)
    return {"exact_match": exact, "bleu": sacrebleu.corpus_bleu(hyps, [refs]).score, "n_test": len(refs),
            "generate_s": time.perf_counter() - t0,
            "examples": [{"source": s, "hypothesis": h, "reference": r}
                         for (s, r), h in list(zip(pairs, hyps))[:3]]}


def run_one(args, family: Family, tok, examples, test_pairs, fused: bool) -> Dict:
    """One run: build the model (same seed each time), convert it when ``fused``, train, evaluate."""
    import fastformer

    model = build_model(args, family, tok.vocab_size)
    result: Dict = {"name": "fastformer" if fused else "transformers"}
    if fused:
        model = fastformer.convert(model, label_smoothing=args.label_smoothing)
        result["fusion"] = fusion_summary(model, family)
    with tempfile.TemporaryDirectory(prefix="hf_seq2seq_dates-") as workdir:  # the Trainer's output_dir; kept empty
        result.update(train(args, family, model, examples, fused, workdir))
    result.update(evaluate(model, family, tok, test_pairs))
    return result


def report_text(report: Dict) -> str:
    s = report["settings"]
    lines = [f"{FAMILIES[s['model']].title} d_model {s['d_model']}, {s['layers']}+{s['layers']} layers, "
             f"{s['heads']} heads, FFN {s['ffn']}, {s['activation']}, vocabulary {s['vocab_size']} (BPE), batch {s['batch_size']}, "
             f"{s['steps']} steps, label smoothing {s['label_smoothing']}, {s['threads']} threads on "
             f"{report['machine']['cpu']}", "",
             f"| run | step ms (median of steps {s['timing_warmup'] + 1}-{s['steps']}) | mean ms | train s "
             f"| final loss | exact match | BLEU |", "|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        loss = r["logged_losses"][-1] if r["logged_losses"] else float("nan")
        lines.append(f"| {r['name']} | {r['step_ms_median']:.1f} | {r['step_ms_mean']:.1f} | "
                     f"{r['train_runtime_s']:.1f} | {loss:.3f} | {100 * r['exact_match']:.1f}% | {r['bleu']:.1f} |")
    if "speedup" in report:
        lines.append(f"\nfastformer.convert: {report['speedup']:.2f}x the plain step's speed (median step times)")
    for r in report["runs"]:
        if "fusion" in r:
            f = r["fusion"]
            lines.append(f"fusion: attention implementation {f['attn_implementation']!r}, {f['fused_layers']} of "
                         f"{f['transformer_layers']} Transformer layers fused, fused loss: {f['fused_loss']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    import transformers

    from fastformer.jobs.bench.report import machine_info

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    family = FAMILIES[args.model]
    tok, examples, test_pairs = make_data(args, family)
    runs = []
    if not args.only_fastformer:
        runs.append(run_one(args, family, tok, examples, test_pairs, fused=False))
    if not args.no_fastformer:
        runs.append(run_one(args, family, tok, examples, test_pairs, fused=True))
    settings = {k: v for k, v in vars(args).items() if k not in ("out",)}
    settings.update(vocab_size=tok.vocab_size, threads=torch.get_num_threads())
    report = {"settings": settings, "runs": runs, "seconds": time.perf_counter() - t0,
              "machine": dict(machine_info(torch.device("cpu")), transformers=transformers.__version__)}
    if len(runs) == 2:
        report["speedup"] = runs[0]["step_ms_median"] / runs[1]["step_ms_median"]
    print(report_text(report), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
