"""examples/deepseek_v3/generate.py run in-process on tiny model directories written by `write_model_dir` (the
trainer's export) from seeded random weights: its JSON tokens against generation.py's `generate` on the same model
and against transformers' `generate` on the `export_hf` directory, the end-of-text id from config.json or from the
tokenizer, text prompts, seeded sampling, and the bad-input errors (all before the weights are read)."""

from __future__ import annotations

import json

import pytest
import torch

from moe.trainer.models.deepseek_v3 import DeepseekV3ForCausalLM, generate_cli
from moe.trainer.models.deepseek_v3.generation import generate
from moe.trainer.models.deepseek_v3.hf import copy_file, export_hf
from moe.trainer.models.deepseek_v3.model_dir import write_model_dir

from .dsv3_testlib import tiny_config

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

script = generate_cli
PROMPTS = ([5, 17, 99, 3, 42], [7], [11, 12, 13, 14, 15, 16, 17, 18])
NEW = 12


def _write(path, config, *, eos=None, tokenizer=None) -> DeepseekV3ForCausalLM:
    """A model of seeded random weights (the init's scaled up tenfold, so the logits are decisive: no near-ties
    for float32 reorderings to flip) written as a model directory; returns the model (eval mode)."""
    torch.manual_seed(3)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(10.0 if "norm" not in name else 1.0)
    extra = (lambda tmp: copy_file(tokenizer, tmp)) if tokenizer is not None else None
    write_model_dir(path, model.full_state_dict(), config, eos_token_id=eos, write_extra=extra)
    return model


def _ids_argv(path, *extra) -> list[str]:
    out = ["--checkpoint", str(path), "--max-new-tokens", str(NEW)]
    for p in PROMPTS:
        out += ["--prompt-ids", ",".join(map(str, p))]
    return out + list(extra)


def _run(argv, out_json) -> dict:
    assert script.main([*argv, "--output-json", str(out_json)]) == 0
    return json.loads(out_json.read_text())


def test_greedy_ids_match_generate_and_transformers(tmp_path, capsys):
    config = tiny_config()
    model = _write(tmp_path / "ckpt", config)
    doc = _run(_ids_argv(tmp_path / "ckpt", "--greedy"), tmp_path / "out.json")
    expected = generate(model, [torch.tensor(p) for p in PROMPTS], NEW)
    assert doc["eos_token_id"] is None
    assert [r["prompt_ids"] for r in doc["results"]] == [list(p) for p in PROMPTS]
    assert [r["generated_ids"] for r in doc["results"]] == [e.tolist() for e in expected]
    assert all(len(r["generated_ids"]) == NEW for r in doc["results"])
    assert doc["prefill"]["tokens"] == sum(map(len, PROMPTS)) and doc["decode"]["tokens"] == 3 * (NEW - 1)
    assert doc["prefill"]["tokens_per_second"] > 0 and doc["decode"]["tokens_per_second"] > 0
    printed = capsys.readouterr().out
    assert "prefill:" in printed and "decode:" in printed and "tokens/s" in printed

    transformers = pytest.importorskip("transformers")
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.eos_token_id is None  # exported as null: transformers' default (1) would stop early
    for p, record in zip(PROMPTS, doc["results"], strict=True):
        with torch.no_grad():
            theirs = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.int64),
                max_new_tokens=NEW,
                do_sample=False,
                pad_token_id=0,
            )[0, len(p) :]
        assert theirs.tolist() == record["generated_ids"], p


def test_stops_at_the_config_eos(tmp_path):
    """config.json's eos_token_id (a token the greedy run makes 4th for prompt 0) ends each sequence after it."""
    config = tiny_config()
    model = _write(tmp_path / "free", config)
    free = generate(model, [torch.tensor(p) for p in PROMPTS], NEW)
    eos = int(free[0][3])
    _write(tmp_path / "ckpt", config, eos=eos)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["eos_token_id"] == eos
    doc = _run(_ids_argv(tmp_path / "ckpt"), tmp_path / "out.json")  # no --greedy: greedy by default
    stopped = generate(model, [torch.tensor(p) for p in PROMPTS], NEW, eos_token_id=eos)
    assert doc["eos_token_id"] == eos
    assert [r["generated_ids"] for r in doc["results"]] == [s.tolist() for s in stopped]
    assert doc["results"][0]["generated_ids"][-1] == eos and len(doc["results"][0]["generated_ids"]) <= 4


def _tokenizer_file(tmp_path, vocab_size: int):
    from moe.trainer.data.token_file import EOS, train_tokenizer

    pytest.importorskip("tokenizers")
    texts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(50)]
    tok = train_tokenizer(texts, vocab_size, "bpe")
    assert tok.token_to_id(EOS) == 0
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path, tok


def test_text_prompts_use_the_tokenizer_and_its_eos(tmp_path, capsys):
    """With no eos in config.json the tokenizer's <|endoftext|> (id 0) is the end; text in, text out."""
    config = tiny_config(vocab_size=300)
    path, tok = _tokenizer_file(tmp_path, config.vocab_size)
    model = _write(tmp_path / "ckpt", config, tokenizer=path)
    texts = ["def f(x):", "return"]
    doc = _run(["--checkpoint", str(tmp_path / "ckpt"), "--prompt", texts[0], "--prompt", texts[1],
                "--max-new-tokens", str(NEW), "--greedy"], tmp_path / "out.json")  # fmt: skip
    ids = [tok.encode(t).ids for t in texts]
    expected = generate(model, [torch.tensor(i) for i in ids], NEW, eos_token_id=0)
    assert doc["eos_token_id"] == 0
    for b, record in enumerate(doc["results"]):
        assert record["prompt"] == texts[b] and record["prompt_ids"] == ids[b]
        assert record["generated_ids"] == expected[b].tolist()
        assert record["continuation"] == tok.decode(expected[b].tolist())
    printed = capsys.readouterr().out
    assert all(repr(t) in printed for t in texts)


def test_sampling_is_reproducible(tmp_path):
    config = tiny_config()
    model = _write(tmp_path / "ckpt", config)

    def sampled(seed: int, name: str) -> list[list[int]]:
        argv = _ids_argv(tmp_path / "ckpt", "--temperature", "3.0", "--top-p", "0.9", "--seed", str(seed))
        return [r["generated_ids"] for r in _run(argv, tmp_path / name)["results"]]

    first, again, other = sampled(5, "a.json"), sampled(5, "b.json"), sampled(6, "c.json")
    assert first == again and first != other
    # One generator per prompt, seeded 5 + its index: a prompt's draws do not depend on its batch or the layout.
    generators = [torch.Generator().manual_seed(5 + i) for i in range(len(PROMPTS))]
    reference = generate(model, [torch.tensor(p) for p in PROMPTS], NEW, temperature=3.0, top_p=0.9,
                         generator=generators)  # fmt: skip
    assert first == [r.tolist() for r in reference]


def test_overlap_with_a_batch_below_two_runs_unsplit(tmp_path, capsys, caplog):
    """Issue 38, item 2 (before: "--overlap splits each rank's batch in two micro-batches: 1 prompts over 1 ranks
    leave 1 per rank, it needs >= 2", exit 2): the same tokens as without --overlap, and one log line saying so."""
    model_dir = tmp_path / "ckpt"
    _write(model_dir, tiny_config())
    argv = ["--checkpoint", str(model_dir), "--max-new-tokens", str(NEW), "--prompt-ids", "5,17,99", "--greedy"]
    plain = _run(argv, tmp_path / "plain.json")
    caplog.clear()
    overlapped = _run([*argv, "--overlap"], tmp_path / "overlap.json")
    assert overlapped["results"] == plain["results"]
    lines = [r.getMessage() for r in caplog.records if "too small to split" in r.getMessage()]
    assert len(lines) == 1, caplog.records
    assert "unsplit (a rank's batch is below 2)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt-ids", ",".join(["1"] * 257)], "max_position_embeddings=256"),
        (["--prompt-ids", ",".join(["1"] * 250), "--max-new-tokens", "8"], "needs 257 positions"),
        (["--prompt-ids", "1,128"], "vocab_size=128"),
        ([], "no prompt"),
        (["--prompt-ids", ""], "comma-separated"),
        (["--prompt-ids", "1,x"], "non-integer"),
        (["--prompt", "a", "--prompt-ids", "1"], "not both"),
        (["--prompt", "text"], "no tokenizer.json"),
        (["--prompt-ids", "1", "--ep", "3"], "--ep 3 does not divide the model's n_routed_experts=8"),
        (["--prompt-ids", "1", "--ep", "2"], "--ep 2 needs 2 processes (torchrun --nproc-per-node 2"),
        (["--prompt-ids", "1", "--ep", "0"], "--ep must be a positive int"),
        (["--prompt-ids", "1", "--fp8-dispatch"], "moves bfloat16 or FP8 rows, the model is torch.float32"),
        (["--prompt-ids", "1", "--dtype", "bfloat16", "--fp8-dispatch"], "FP8 dispatch needs hidden_size a multiple"),
        (
            ["--prompt-ids", "1", "--dtype", "bfloat16", "--decode-dispatcher", "flex", "--fp8-dispatch"],
            "FP8 dispatch runs on the low-latency dispatcher",
        ),
        (
            [
                "--prompt-ids",
                "1",
                "--prompt-ids",
                "2",
                "--prompt-ids",
                "3",
                "--dtype",
                "bfloat16",
                "--decode-dispatcher",
                "flex_ll",
                "--num-max-dispatch-tokens-per-rank",
                "2",
            ],
            "dispatches 3 tokens per rank",
        ),
        (["--prompt-ids", "1", "--prompt-ids", "2", "--timeline", "x"], "--timeline draws the overlapped"),
        (["--prompt-ids", "1", "--chunked-prefill-size", "0"], "--chunked-prefill-size must be >= 1"),
        (["--prompt-ids", "1", "--greedy", "--seed", "1"], "--greedy takes no"),
        (["--prompt-ids", "1", "--top-p", "0.5"], "need --temperature"),
        (["--prompt-ids", "1", "--temperature", "1", "--top-p", "0"], "top_p"),
        (["--prompt-ids", "1", "--max-new-tokens", "0"], "max_new_tokens"),
    ],
)
def test_bad_input_fails_before_loading(tmp_path, capsys, monkeypatch, argv, message):
    _write(tmp_path / "ckpt", tiny_config())
    monkeypatch.setattr(script, "load_for_decoding", lambda *a, **k: pytest.fail("loaded the weights"))
    assert script.main(["--checkpoint", str(tmp_path / "ckpt"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("generate.py: error:") and message in err, err


def test_a_checkpoint_of_another_model(tmp_path, capsys):
    """A model directory whose config.json describes another architecture (here Llama's keys) is refused before any
    weight is read, instead of being read as DeepSeek-V3 with default fields."""
    _write(tmp_path / "ckpt", tiny_config())
    doc = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    doc.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(doc))
    assert script.main(["--checkpoint", str(tmp_path / "ckpt"), "--prompt-ids", "1"]) == 2
    assert "model_type='llama' is another model, not DeepSeek-V3" in capsys.readouterr().err


def test_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text(json.dumps(tiny_config().to_hf_dict()))
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad_config").mkdir()
    (tmp_path / "bad_config" / "config.json").write_text("{not json")
    (tmp_path / "bad_config" / "model.safetensors").write_bytes(b"")
    cases = {"missing": "no such directory", "empty": "no config.json", "config_only": "neither model.safetensors"}
    cases["bad_config"] = "config.json"
    for name, message in cases.items():
        assert script.main(["--checkpoint", str(tmp_path / name), "--prompt-ids", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("generate.py: error:") and message in err, (name, err)
