"""allocsim.torch against a stand-in for torch: the calls it makes, the files it writes, and the
explanation of a recorded OOM (the snapshot the stand-in returns is a real one, frag__default__2048M,
whose OOM PyTorch's message is known for). The real thing ran on an H200 (see the README)."""

import os
import pickle
import subprocess
import sys
import types

import pytest

import allocsim
from conftest import ROOT, meta, snapshot_dict, without_nvml

FRAG = "frag__default__2048M.pickle.gz"
TOTAL = 150109880320  # the H200 the trace was recorded on


class FakeTorch:
    """The parts of torch allocsim.torch uses, recording every call."""

    def __init__(self, snapshot):
        self.snapshot = snapshot
        self.calls = []
        self.observers = []
        self.rank = None
        torch = types.ModuleType("torch")
        cuda = types.ModuleType("torch.cuda")
        memory = types.ModuleType("torch.cuda.memory")
        c = types.ModuleType("torch._C")
        dist = types.ModuleType("torch.distributed")
        memory._record_memory_history = lambda enabled="all", **kw: self.calls.append(("history", enabled, kw))
        memory._snapshot = self._snapshot
        memory._dump_snapshot = self._dump
        cuda.memory = memory
        cuda.current_device = lambda: 0
        cuda.get_device_properties = lambda d: types.SimpleNamespace(total_memory=TOTAL)
        c._cuda_attach_out_of_memory_observer = self.observers.append
        dist.is_available = lambda: True
        dist.is_initialized = lambda: self.rank is not None
        dist.get_rank = lambda: self.rank
        torch.cuda, torch._C, torch.distributed = cuda, c, dist
        self.module = torch
        self.modules = {"torch": torch, "torch.cuda": cuda, "torch.cuda.memory": memory, "torch._C": c, "torch.distributed": dist}

    def _snapshot(self):
        if isinstance(self.snapshot, Exception):
            raise self.snapshot
        return self.snapshot

    def _dump(self, path):
        self.calls.append(("dump", path))
        with open(path, "wb") as f:
            pickle.dump(self._snapshot(), f)

    def oom(self, device=0, alloc=256 << 20, limit=2 << 30, free=None):
        """What the allocator does on an OOM: call every observer (the last OOM entry's numbers)."""
        if free is None:
            free = [e for e in self.snapshot["device_traces"][0] if e["action"] == "oom"][-1]["device_free"]
        for obs in self.observers:
            obs(device, alloc, limit, free)


@pytest.fixture
def fake(monkeypatch):
    f = FakeTorch(snapshot_dict(FRAG))
    for name, mod in f.modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    import allocsim.torch as at

    return f, at


def test_importing_allocsim_torch_does_not_import_torch():
    code = "import sys, allocsim, allocsim.torch; assert 'torch' not in sys.modules; print('ok')"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0 and p.stdout == "ok\n", p.stderr


def test_oom_hook_writes_the_snapshot_and_pytorchs_numbers(fake, tmp_path, capsys):
    f, at = fake
    hook = at.install_oom_hook(tmp_path / "dumps", max_entries=5000)
    assert f.calls == [("history", "all", {"context": "all", "stacks": "python", "max_entries": 5000})]
    assert f.observers == [hook]
    f.oom()
    assert hook.count == 1 and hook.error is None
    snap, txt, js = hook.written
    assert [os.path.dirname(p) for p in hook.written] == [str(tmp_path / "dumps")] * 3
    assert os.path.basename(snap).startswith("oom_") and snap.endswith(".pickle")
    assert txt == snap[: -len(".pickle")] + ".txt" and js == snap[: -len(".pickle")] + ".json"
    # The dumped file is the snapshot torch returned.
    assert allocsim.load(snap) == allocsim.load(f.snapshot)
    # The explanation is of the last OOM the history holds (request 302, 1024 MiB), and states
    # PyTorch's message for it as the recorded job printed it.
    import json

    d = json.load(open(js))
    recorded = meta(FRAG)["log"][-1]["exception"]
    assert d["request"] == 302
    assert d["message"] == without_nvml(recorded)
    assert d["observer"] == {"device": 0, "alloc_size": 256 << 20, "limit_or_total": 2 << 30, "device_free": d["observer"]["device_free"], "device_total": TOTAL}
    text = open(txt).read()
    assert text.startswith("PyTorch's out-of-memory observer: device 0, tried to allocate 256.00 MiB (268435456 bytes); the allowed maximum 2.00 GiB")
    assert str(allocsim.load(snap).explain(at=302, device=0, device_memory=TOTAL)) in text
    assert without_nvml(recorded) in text
    err = capsys.readouterr().err
    assert f"wrote {snap}, {txt}, {js}" in err


def test_oom_hook_never_raises(fake, tmp_path, capsys):
    f, at = fake
    hook = at.install_oom_hook(tmp_path, record=False)
    assert f.calls == []
    f.snapshot = RuntimeError("CUDA error: an illegal memory access was encountered")
    f.observers[0](0, 1 << 30, 2 << 30, 0)  # does not raise
    assert hook.count == 0
    assert hook.error == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert "allocsim: the OOM hook could not write its files: RuntimeError" in capsys.readouterr().err


def test_oom_hook_without_explanation_and_with_a_rank(fake, tmp_path):
    f, at = fake
    f.rank = 3
    hook = at.install_oom_hook(tmp_path, explain=False, quiet=True)
    f.oom()
    f.oom()
    assert hook.count == 2
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 2 and all(n.startswith("oom_rank3_") and n.endswith(".pickle") for n in names)


def test_record_dumps_on_exit_and_on_oom(fake, tmp_path):
    f, at = fake
    with at.record(tmp_path, max_entries=1000, stacks="all") as rec:
        assert f.calls == [("history", "all", {"context": "all", "stacks": "all", "max_entries": 1000})]
        f.oom()
        assert rec.hook.count == 1
    assert rec.path == str(tmp_path / "snapshot.pickle")
    assert f.calls[-2] == ("dump", rec.path)
    assert f.calls[-1] == ("history", None, {})
    assert allocsim.load(rec.path).validate().exact
    # After the block the observer (torch cannot detach it) does nothing.
    f.oom()
    assert rec.hook.count == 1
    assert len([n for n in os.listdir(tmp_path) if n.startswith("oom_")]) == 3


def test_record_names_the_rank_and_dumps_when_the_block_raises(fake, tmp_path):
    f, at = fake
    f.rank = 1
    with pytest.raises(KeyError):
        with at.record(tmp_path, on_oom=False) as rec:
            raise KeyError("step")
    assert rec.hook is None
    assert rec.path == str(tmp_path / "snapshot_rank1.pickle") and os.path.exists(rec.path)
    assert f.calls[-1] == ("history", None, {})
    # A second recording does not overwrite the first.
    with at.record(tmp_path, on_oom=False) as rec2:
        pass
    assert rec2.path == str(tmp_path / "snapshot_rank1-2.pickle")


def test_explain_now_explains_the_live_state(fake):
    f, at = fake
    x = at.explain_now()
    s = allocsim.load(f.snapshot, name="torch.cuda.memory._snapshot()")
    assert str(x) == str(s.explain(at=302, device=0, device_memory=TOTAL))
    assert x.request == 302
    # Another request: the state there.
    assert at.explain_now(at=10).request == 10


def test_explain_now_needs_the_history(fake):
    f, at = fake
    f.snapshot = {"segments": [], "device_traces": [[]]}
    with pytest.raises(RuntimeError, match="no allocation history on device 0"):
        at.explain_now()


def test_oom_hook_keeps_the_snapshot_when_the_explanation_fails(fake, tmp_path, monkeypatch, capsys):
    f, at = fake

    def broken(self, *a, **k):
        raise allocsim.TraceError("snapshot: device 0, trace entry 7 (alloc): size out of range")

    monkeypatch.setattr(allocsim.Snapshot, "explain", broken)
    hook = at.install_oom_hook(tmp_path)
    f.oom()
    assert hook.count == 1
    assert len(hook.written) == 1 and os.path.exists(hook.written[0])
    assert hook.error == "the explanation failed: TraceError: snapshot: device 0, trace entry 7 (alloc): size out of range"
    err = capsys.readouterr().err
    assert "allocsim: the explanation failed: TraceError" in err and f"wrote {hook.written[0]}" in err


def llama_oom_annotated():
    """llama_oom's snapshot with each step annotated as allocsim.torch.step(seq=L) records it (from
    the end of one optimizer step to the end of the next), up to the step that ran out of memory,
    whose region is still open (the observer runs inside the failing allocation)."""
    snap = snapshot_dict("field/llama_oom__default.pickle.gz")
    m = meta("field/llama_oom__default.pickle.gz")
    seq, oom_step = m["extra"]["seq_lens"], m["log"][0]["step"]
    ends = sorted(a["time_us"] for a in snap["external_annotations"] if a["stage"] == "END" and a["name"].startswith("Optimizer.step"))
    start = snap["device_traces"][0][0]["time_us"]
    for k in range(oom_step + 1):
        snap["external_annotations"].append({"stage": "START", "name": f"seq={seq[k]}", "device": 0, "time_us": start})
        if k < oom_step:
            snap["external_annotations"].append({"stage": "END", "name": f"seq={seq[k]}", "device": 0, "time_us": ends[k]})
            start = ends[k] + 1
    return snap, m


def test_oom_hook_ends_with_the_largest_shape_that_would_have_fit(monkeypatch, tmp_path):
    snap, m = llama_oom_annotated()
    f = FakeTorch(snap)
    for name, mod in f.modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    import allocsim.torch as at

    hook = at.install_oom_hook(tmp_path, quiet=True)
    f.oom(alloc=176 << 20, limit=m["cap_bytes"])
    assert hook.error is None, hook.error
    _, txt, js = hook.written
    import json

    d = json.load(open(js))
    largest = d["largest_shape"]
    # The job ran 512 under the cap and ran out of memory at 4096.
    assert largest["param"] == "seq" and 512 <= largest["value"] < 4096
    assert largest["capacity"] == m["cap_bytes"]
    last = open(txt).read().rstrip("\n").split("\n")[-1]
    assert last.startswith(f"The largest seq that would have fit: {largest['value']} (largest seq under an allowed maximum of 6.00 GiB")
    # The same as allocsim.scale on the snapshot, under the cap.
    r = allocsim.load(snap).scale("seq", largest_under=m["cap_bytes"], device_memory=TOTAL)
    assert r.largest_value == largest["value"]


def test_step_is_a_record_function_region(monkeypatch):
    names = []

    class Rf:
        def __init__(self, name):
            names.append(name)

        def __enter__(self):
            names.append("enter")

        def __exit__(self, *a):
            names.append("exit")

    f = FakeTorch(None)
    f.module.autograd = types.SimpleNamespace(profiler=types.SimpleNamespace(record_function=Rf))
    for name, mod in f.modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    import allocsim.torch as at

    with at.step(seq=512):
        names.append("body")
    assert names == ["seq=512", "enter", "body", "exit"]
    with pytest.raises(TypeError):
        with at.step(seq=1, batch=2):
            pass
    with pytest.raises(ValueError):
        with at.step(seq=0):
            pass
