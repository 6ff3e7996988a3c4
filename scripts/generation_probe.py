"""Issue 41 item 4 on the GPU: a Hugging Face Llama's greedy generation through einfold
attention against SDPA, and decode at lengths between powers of two against an
earlier revision.

    python3 scripts/generation_probe.py [REVISION ...]     (REVISION: a package in .before/)

Generation: each implementation in a fresh process (Python, CUDA, einfold's module
cache and Triton's cache fresh: a user's very first call), then (this tree's) a second
process on the same cache folders (a later session), and one with fresh caches loading
the tuning records the first einfold process saved (EINFOLD_TUNING: a machine of the same
GPU model with the shipped choices), each generating 32 tokens after a prompt of
100, then 32 after a prompt of 77 (a new length in a warm process).  Printed: seconds
of each generation, the einfold modules the process loaded, and whether the tokens
equal SDPA's.  Decode: `O[b,g,r,i,j]` over cache lengths between powers of two,
this tree against each revision, one process (each revision its own modules).
Writes $OUT/generation.json; the last lines are a short table."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)


def generate(implementation: str) -> None:
    """Child: generate with `implementation` (sdpa, or einfold from PACKAGE) and print JSON."""
    import importlib

    import torch
    import transformers
    package = os.environ.get("PACKAGE", "compiler")
    if implementation == "einfold":
        sys.path.insert(0, str(ROOT / ".before"))
        importlib.import_module(f"{package}.integrations.transformers").register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation,
                                                          dtype=torch.bfloat16).cuda().eval()
    out = {}
    for prompt in (100, 77):
        ids = torch.randint(0, CONFIG["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(prompt))
        ids = ids.cuda()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.no_grad():
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                    min_new_tokens=32, do_sample=False)
        torch.cuda.synchronize()
        out[f"prompt {prompt} s"] = round(time.perf_counter() - start, 3)
        out[f"prompt {prompt} peak MiB"] = round(torch.cuda.max_memory_allocated() / 2 ** 20)
        out[f"prompt {prompt} tokens"] = tokens[0, prompt:].tolist()
        out[f"prompt {prompt} modules"] = len([n for n in sys.modules if n.startswith("einfold_")])
    if implementation == "einfold" and os.environ.get("SAVE_TUNING"):
        importlib.import_module(package).save_tuning(os.environ["SAVE_TUNING"])
    print("RESULT " + json.dumps(out))


def decode(revisions: list[str]) -> None:
    """Child: decode attention at lengths between powers of two, this tree against `revisions`."""
    import math

    import torch
    import triton.testing
    from compare_revisions import revisions as loaded
    packages = loaded(revisions)
    source = "O[b,g,r,i,j] = softmax[m](Q[b,g,r,i,k] * K[b,g,m,k] * scale) * V[b,g,m,j]"
    programs = {tag: p.compile(source, backend="triton") for tag, p in packages.items()}
    rows = []
    for length in (3000, 6000, 12000, 50000, 100000):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, 8, 4, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, 8, length, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        x = {"Q": q, "K": k, "V": v, "scale": 1 / math.sqrt(128)}
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.flatten(1, 2).float(), k.repeat_interleave(4, 1).float(), v.repeat_interleave(4, 1).float(),
            scale=x["scale"])
        row = {"length": length}
        for _ in range(3):
            for tag, p in programs.items():
                got = p(**x).flatten(1, 2).float()
                assert (got - ref).abs().max().item() < 2e-2, (tag, length)
                ms = triton.testing.do_bench(lambda p=p: p(**x), warmup=25, rep=100)
                row.setdefault(tag, []).append(ms)
        rows.append({"length": length, **{tag: sorted(ms)[1] for tag, ms in row.items() if tag != "length"}})
        print(json.dumps(rows[-1]), flush=True)
    print("RESULT " + json.dumps(rows))


def child(args: list[str], env: dict, limit: int) -> dict | list | str:
    try:
        done = subprocess.run([sys.executable, __file__, *args], env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return f"past {limit} s"
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not found:
        return "failed: " + (done.stderr.strip().splitlines() or ["?"])[-1][:300]
    return json.loads(found[-1][len("RESULT "):])


def main(revisions: list[str]) -> None:
    out = Path(os.environ.get("OUT", "."))
    results: dict = {}
    contenders = [("sdpa", "sdpa", "compiler"), ("einfold", "einfold", "compiler")] + \
        [(f"einfold {r}", "einfold", r) for r in revisions]
    records = f"{tempfile.mkdtemp(prefix='gen-')}/tuning.json"
    for label, implementation, package in contenders:
        folder = tempfile.mkdtemp(prefix="gen-")
        env = {"PACKAGE": package, "EINFOLD_CACHE_DIR": f"{folder}/einfold", "TRITON_CACHE_DIR": f"{folder}/triton"}
        if label == "einfold":
            env["SAVE_TUNING"] = records           # the cold run's choices, for the run below
        for run in ("cold", "warm") if package == "compiler" else ("cold",):
            results[f"{label} ({run} caches)"] = child(["generate", implementation], env, 240)
            print(label, run, results[f"{label} ({run} caches)"] if isinstance(
                results[f"{label} ({run} caches)"], str) else "", flush=True)
    if os.path.exists(records):
        # empty caches, but the tuning records of the cold run (another machine of this GPU model)
        folder = tempfile.mkdtemp(prefix="gen-")
        results["einfold (cold caches, tuning records)"] = child(["generate", "einfold"], {
            "PACKAGE": "compiler", "EINFOLD_CACHE_DIR": f"{folder}/einfold", "TRITON_CACHE_DIR": f"{folder}/triton",
            "EINFOLD_TUNING": records}, 240)
    if revisions:
        results["decode"] = child(["decode", *revisions], {}, 240)
    (out / "generation.json").write_text(json.dumps(results, indent=1))
    sdpa = results.get("sdpa (cold caches)")
    print("\n| implementation | 1st generation s | 2nd (new prompt) s | peak MiB | modules | tokens = SDPA's |")
    print("|---|---:|---:|---:|---:|---|")
    for label, r in results.items():
        if label == "decode":
            continue
        if isinstance(r, str):
            print(f"| {label} | {r} | | | | |")
            continue
        same = isinstance(sdpa, dict) and r["prompt 100 tokens"] == sdpa["prompt 100 tokens"]
        print(f"| {label} | {r['prompt 100 s']} | {r['prompt 77 s']} | {r['prompt 100 peak MiB']} | "
              f"{r['prompt 77 modules']} | {same} |")
    if isinstance(results.get("decode"), list):
        print("\n| decode length | this tree ms | " + " | ".join(f"{r} / this tree" for r in revisions) + " |")
        for row in results["decode"]:
            print(f"| {row['length']} | {row['new']:.4f} | "
                  + " | ".join(f"{row[r] / row['new']:.3f}x" for r in revisions) + " |")
    elif "decode" in results:
        print("decode:", results["decode"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["generate"]:
        generate(sys.argv[2])
    elif sys.argv[1:2] == ["decode"]:
        decode(sys.argv[2:])
    else:
        main(sys.argv[1:])
