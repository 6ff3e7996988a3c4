"""scripts/plot_targets.py reads issue 13's targets off bench JSON: each bar's value,
its target and whether it meets it (the figure and the table in docs/performance.md)."""
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "scripts", "plot_targets.py")
spec = importlib.util.spec_from_file_location("plot_targets", SCRIPT)
# registered before it runs: its dataclass looks its own module up
plot_targets = sys.modules["plot_targets"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_targets)


def row(group, name, contender, ms, rate=float("nan")):
    return {"group": group, "name": name, "contender": contender, "ms": ms, "rate": rate}


def test_each_target_is_read_off_its_rows(tmp_path):
    meta = {"device": "GPU", "torch": "t", "triton": "3.6", "date": "d", "copy_bandwidth_GBps": 3000.0}
    first = [row("attention", "B16 H16 S1024 d128", "einfold", 1.0),
             row("attention", "B16 H16 S1024 d128", "sdpa_cudnn", 0.8),
             row("attention", "B4 H32 S4096 d64", "einfold", 1.0),
             row("attention", "B4 H32 S4096 d64", "sdpa_cudnn", 0.95),
             row("flex", "alibi B16 H16 S1024 d128", "einfold", 1.0),
             row("flex", "alibi B16 H16 S1024 d128", "flex_attention", 1.05),
             row("compile", "flex alibi B16 H16 S1024 d128 first call", "einfold", 4000.0),
             row("compile", "flex alibi B16 H16 S1024 d128 first call", "flex_attention", 1900.0),
             row("host", "attention B1 H1 S16 d64", "einfold", 19.0),
             row("host", "attention B1 H1 S16 d64", "einfold captured", 3.0),
             row("host", "attention B1 H1 S16 d64", "sdpa", 20.0)]
    second = [row("memory", "logsumexp 8192x8192 bfloat16", "einfold", 0.05, 2604.0),
              row("memory", "logsumexp 8192x8192 bfloat16", "torch.compile", 0.07, 1880.0),
              row("decode", "H8 L8192", "einfold", 0.028),
              row("decode", "H8 L8192", "sdpa_cudnn_attention", 0.027),
              # a later file's row replaces an earlier one's
              row("host", "attention B1 H1 S16 d64", "einfold", 21.0)]
    paths = []
    for k, rows in enumerate((first, second)):
        paths.append(tmp_path / f"{k}.json")
        paths[-1].write_text(json.dumps({"meta": meta, "rows": rows}))
    rows, read_meta = plot_targets.rows_of([str(p) for p in paths])
    bars = {title: {b.label: b for b in group} for title, group in plot_targets.panels(rows, read_meta)}
    attention = bars["attention forward: cuDNN time / einfold's"]
    s1k = attention["S1k d128"]
    assert (s1k.value, s1k.target, s1k.met) == (0.8, 0.78, True)
    assert (attention["S4k d64"].target, attention["S4k d64"].met) == (0.9, True)
    flex = bars["FlexAttention variants: Flex time / einfold's"]["alibi S1k d128"]
    assert (flex.value, flex.target, flex.met) == (1.05, 1.1, False)
    (first_call,) = bars["first call: einfold's / FlexAttention's"].values()
    assert first_call.label == "alibi S1k d128 (4.0 s)" and first_call.value > 2 and not first_call.met
    (decode,) = bars["decode: cuDNN time / einfold's"].values()
    assert decode.label == "H8 L8k" and decode.met
    (memory,) = bars["memory-bound: % of copy bandwidth"].values()
    assert round(memory.value, 1) == 86.8 and not memory.met
    (compiled,) = bars["memory-bound: torch.compile time / einfold's"].values()
    assert compiled.met
    (host,) = bars["cached call: host time, µs"].values()
    assert (host.value, host.met) == (21.0, False)
    (over,) = bars["cached call: host time over the baseline's"].values()
    assert over.label == "attention B1 H1 S16 d64 / sdpa" and over.value == 21.0 / 20.0 and over.met
