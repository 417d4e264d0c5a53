"""Tokenization pipeline (`moe.trainer.data.tokenize`): its speed against Hugging Face `tokenizers`' own `encode_batch`,
and its peak memory on a corpus far larger than it.

Corpus: generated JSONL shards (`--size-mb` in all, 64 MiB per shard) under a temporary directory (`--dir`, deleted
afterwards unless `--keep`). `--text code` (default): records of 1-8 KiB cut at random from this Python's standard
library sources (code and prose: real BPE work, about 4 bytes per token). `--text words`: records of 40-320 words
drawn from 256 random 16-32-letter words, with a word-level tokenizer of them (`tokenizers` WordLevel on
WhitespaceSplit, about 25 bytes per token): the same bytes through reading, JSON checks, the workers and the
writer for a fraction of the encoding work, so that a corpus of gigabytes runs through a loaded 2-core machine in
minutes for the memory figure. Tokenizer of "code": byte-level BPE of `--vocab-size` trained on the first 4 MB of
the stdlib.
Both sides are held to `--cores` CPUs (affinity, inherited by the workers; rayon's pool sized to match).

- speed (default): "ours" is `tokenize_corpus(..., workers=--workers)` end to end: worker start (spawned
  processes import the library), reading, JSON parsing and checks, encoding, writing the indexed shards.
  "encode_batch" is `Tokenizer.encode_batch(texts, add_special_tokens=False)` over the same documents already in
  memory, 1024 per call, on the same cores (its rayon threads), counting each document's end-of-text token too,
  no reading, no writing. Tokens/s of each and their ratio (ours / encode_batch), also with the pipeline's fixed
  cost taken out (what a 20-record run of it takes: starting the workers, which import the library, and stopping
  them), which a corpus of gigabytes makes negligible.
- Peak memory (every run; `--rss` skips encode_batch): the pipeline runs alone in a fresh process (`--child`),
  started by this process, which imports nothing of the library (generating and training run in another,
  `--prepare`). It reports its own and its largest worker's peak RSS as VmHWM (/proc, sampled every 0.2 s for the
  workers) and as `resource.getrusage` SELF / CHILDREN ru_maxrss, against the corpus's size. Linux carries
  ru_maxrss across fork and exec, so the workers' getrusage figure is at least the parent's RSS when they were
  spawned; VmHWM is each process's own.

Run (2 cores; under 10 minutes together):

    .venv/bin/python bench/tokenization.py --size-mb 64
    .venv/bin/python bench/tokenization.py --rss --text words --size-mb 3072
"""

from __future__ import annotations

import os
import sys

# This file is named like the standard library's `tokenize` (which linecache, traceback and inspect import): take
# its directory off the path before anything can import `tokenize` and get this script.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

SHARD_BYTES = 64 << 20


def _pin(cores: int) -> None:
    available = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, available[:cores])
    os.environ["RAYON_NUM_THREADS"] = str(cores)  # before tokenizers starts its pool


def generate(directory: Path, size_mb: int, text: str = "code", seed: int = 0) -> int:
    """JSONL shards of about `size_mb` MiB in all, `text` "code" or "words" (module docstring); returns the bytes
    written."""
    from moe.trainer.data.corpus import Corpus

    rng = random.Random(seed)
    if text == "code":
        source = "".join(Corpus("python-stdlib").texts())

        def record() -> str:
            start = rng.randrange(len(source) - 8192)
            return source[start : start + rng.randint(1024, 8192)]
    else:
        letters = "abcdefghijklmnopqrstuvwxyz"
        words = ["".join(rng.choices(letters, k=rng.randint(16, 32))) for _ in range(256)]

        def record() -> str:
            return " ".join(rng.choices(words, k=rng.randint(40, 320)))

    directory.mkdir(parents=True, exist_ok=True)
    total, shard = 0, 0
    while total < size_mb << 20:
        lines, size = [], 0
        while size < SHARD_BYTES and total + size < size_mb << 20:
            line = json.dumps({"id": rng.getrandbits(32), "text": record()})
            lines.append(line)
            size += len(line) + 1
        (directory / f"shard-{shard:04d}.jsonl").write_text("\n".join(lines) + "\n")
        total += size
        shard += 1
    return total


def _hwm(pid: str | int = "self") -> int:
    """VmHWM, the peak RSS (bytes) of a process's own memory (reset by exec, unlike ru_maxrss); 0 once gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _watch_children(peaks: dict, stop: threading.Event) -> None:
    """Samples the VmHWM of this process's children (the workers) until `stop`: the high-water mark only grows, so
    the last sample is each worker's peak up to 0.2 s before it exits."""
    while not stop.is_set():
        for task in Path("/proc/self/task").iterdir():
            try:
                pids = (task / "children").read_text().split()
            except OSError:
                continue
            for pid in pids:
                peaks[pid] = max(peaks.get(pid, 0), _hwm(pid))
        stop.wait(0.2)


def _child(corpus_dir: str, tokenizer_path: str, out_dir: str, workers: int) -> None:
    """The pipeline alone, in a fresh process; prints one JSON line with its figures and peak RSS."""
    from moe.trainer.data.corpus import Corpus
    from moe.trainer.data.tokenize import tokenize_corpus
    from moe.trainer.data.tokenizer import load_tokenizer

    corpus = Corpus(corpus_dir)
    tok = load_tokenizer(tokenizer_path)
    # The fixed cost (spawning the workers, which import the library, and stopping them): a 20-record corpus.
    tiny = Path(out_dir).parent / "tiny"
    tiny.mkdir()
    with open(corpus.files[0].path) as f:
        (tiny / "tiny.jsonl").write_text("".join(next(f) for _ in range(20)))
    start = time.perf_counter()
    tokenize_corpus(Corpus(tiny), tok, tiny / "out", workers=workers, progress=False)
    fixed = time.perf_counter() - start
    peaks: dict = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_children, args=(peaks, stop), daemon=True)
    watcher.start()
    start = time.perf_counter()
    out = tokenize_corpus(corpus, tok, out_dir, workers=workers, progress=False)
    seconds = time.perf_counter() - start
    stop.set()
    watcher.join()
    kib = 1024  # ru_maxrss is in KiB on Linux
    figures = {
        "corpus_bytes": corpus.total_bytes,
        "tokens": out.num_tokens,
        "documents": out.manifest["num_documents"],
        "shards": len(out.prefixes),
        "seconds": seconds,
        "fixed_seconds": fixed,
        "parent_vmhwm": _hwm(),
        "worker_vmhwm": max(peaks.values(), default=0),
        # getrusage: Linux carries ru_maxrss over fork and exec, so a spawned worker's figure is at least its
        # parent's RSS when it was started (hence VmHWM above, each process's own memory).
        "parent_ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib,
        "worker_ru_maxrss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kib,
    }
    print(json.dumps(figures))


def _prepare(work: str, size_mb: int, text: str, vocab_size: int) -> None:
    """Generate the corpus and train the tokenizer (its own process: the measured ones start small)."""
    from moe.trainer.data.corpus import Corpus
    from moe.trainer.data.tokenizer import capped, train_tokenizer
    from moe.trainer.models.deepseek_v3.model_tokens import END_OF_TEXT

    work_dir = Path(work)
    start = time.perf_counter()
    written = generate(work_dir / "corpus", size_mb, text)
    if text == "code":
        tok = train_tokenizer(Corpus("python-stdlib").texts(), vocab_size, max_bytes=4_000_000)
        path = tok.save(work_dir / "tokenizer")
    else:  # a word-level tokenizer of the generated words: its cost per byte is a split and a lookup
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        trainer = trainers.WordLevelTrainer(special_tokens=[END_OF_TEXT, "[UNK]"], show_progress=False)
        tok.train_from_iterator(capped(Corpus(work_dir / "corpus").texts(), 4_000_000), trainer)
        (work_dir / "tokenizer").mkdir()
        path = work_dir / "tokenizer" / "tokenizer.json"
        tok.save(str(path))
    print(json.dumps({"bytes": written, "seconds": time.perf_counter() - start, "tokenizer": str(path)}))


def _reference(corpus_dir: str, tokenizer_path: str) -> None:
    """Prints (tokens, seconds) of encode_batch over the corpus's documents, read into memory first (not timed)."""
    from moe.trainer.data.corpus import Corpus
    from moe.trainer.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_path)
    texts = list(Corpus(corpus_dir).texts())
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(texts), 1024):
        for enc in tok.tokenizer.encode_batch(texts[i : i + 1024], add_special_tokens=False):
            tokens += len(enc.ids) + 1  # + the end-of-text token the pipeline writes
    print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - start}))


def _run(*args) -> dict:
    done = subprocess.run([sys.executable, __file__, *map(str, args)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{args[0]} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


STEPS = {"--child": _child, "--prepare": _prepare, "--reference": _reference}


def main() -> None:
    if sys.argv[1:2] and sys.argv[1] in STEPS:
        step, *rest = sys.argv[1:]
        STEPS[step](*[int(a) if a.isdigit() else a for a in rest])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=64, help="generated corpus size (MiB)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--text", choices=("code", "words"), default="code", help="generated text (docstring)")
    parser.add_argument("--rss", action="store_true", help="peak RSS of the pipeline (no encode_batch run)")
    parser.add_argument("--dir", default=None, help="where to generate (default: a temporary directory in /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the generated corpus and outputs")
    args = parser.parse_args()
    _pin(args.cores)  # this process imports no library: the measured steps run in fresh processes
    work = Path(tempfile.mkdtemp(prefix="bench-tokenize-", dir=args.dir))
    mib = 2**20
    try:
        prep = _run("--prepare", work, args.size_mb, args.text, args.vocab_size)
        print(f"generated {prep['bytes'] / mib:.0f} MiB of JSONL ({args.text}) + tokenizer in {prep['seconds']:.0f} s")
        ours = _run("--child", work / "corpus", prep["tokenizer"], work / "out", args.workers)
        ours_tps = ours["tokens"] / ours["seconds"]
        steady_tps = ours["tokens"] / (ours["seconds"] - ours["fixed_seconds"])
        print(
            f"ours: {ours['tokens']} tokens, {ours['documents']} documents, {ours['shards']} shards in "
            f"{ours['seconds']:.1f} s = {ours_tps / 1e6:.3f} M tokens/s ({args.workers} workers, {args.cores} cores); "
            f"fixed cost (a 20-record run) {ours['fixed_seconds']:.1f} s, without it {steady_tps / 1e6:.3f} M tokens/s"
        )
        print(
            f"peak RSS (VmHWM): parent {ours['parent_vmhwm'] / mib:.0f} MiB, largest worker "
            f"{ours['worker_vmhwm'] / mib:.0f} MiB; getrusage ru_maxrss: self {ours['parent_ru_maxrss'] / mib:.0f}"
            f" MiB, children {ours['worker_ru_maxrss'] / mib:.0f} MiB; corpus {ours['corpus_bytes'] / mib:.0f} MiB"
        )
        if not args.rss:
            ref = _run("--reference", work / "corpus", prep["tokenizer"])
            if ref["tokens"] != ours["tokens"]:
                raise SystemExit(f"token counts differ: ours {ours['tokens']}, encode_batch {ref['tokens']}")
            ref_tps = ref["tokens"] / ref["seconds"]
            print(f"encode_batch: {ref['tokens']} tokens in {ref['seconds']:.1f} s = {ref_tps / 1e6:.3f} M tokens/s")
            ratio, steady = ours_tps / ref_tps, steady_tps / ref_tps
            print(f"ratio ours / encode_batch: {ratio:.2f} ({steady:.2f} without the fixed cost)")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
