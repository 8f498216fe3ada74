"""allocsim.fleet: the ranks of a job compared in processes or Ray tasks give the answer of
`allocsim compare` on the same files (its JSON, parsed, and its text), damaged files included."""

import gzip
import json
import os
import shutil
import subprocess
import sys

import pytest

import allocsim
import allocsim.fleet
from conftest import ROOT, cli, need

# The rank recordings in traces/ (two DDP ranks of one job; rank 1 spikes in step 6).
RANKS = "traces/field/ranks"
RANK_FILES = ["traces/field/ranks/rank0.pickle.gz", "traces/field/ranks/rank1.pickle.gz"]


def cli_json(*args):
    p = cli("compare", *args, "--json")
    return p, json.loads(p.stdout)


@pytest.fixture(scope="module")
def ray():
    ray = need("ray", "the tests on a local Ray instance (test_fleet.py, fixture ray)")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def damaged(tmp_path):
    """A directory of four ranks: the two recordings, rank 1 cut in half, and a file that is not
    a snapshot at all."""
    d = tmp_path / "job"
    d.mkdir()
    for f in RANK_FILES:
        shutil.copy(os.path.join(ROOT, f), d / os.path.basename(f))
    data = (d / "rank1.pickle.gz").read_bytes()
    raw = gzip.decompress(data)
    (d / "rank2.pickle.gz").write_bytes(gzip.compress(raw[: len(raw) // 2]))
    (d / "rank3.pickle").write_bytes(b"not a snapshot\n")
    return str(d)


def test_the_rank_recordings_are_there():
    assert all(os.path.exists(os.path.join(ROOT, f)) for f in RANK_FILES)
    assert allocsim.fleet.expand(RANKS) == RANK_FILES
    assert allocsim.fleet.expand(RANKS + "/rank*.pickle.gz") == RANK_FILES
    assert allocsim.fleet.expand(RANK_FILES[::-1]) == RANK_FILES[::-1]


def test_local_engine_gives_the_command_lines_answer():
    p, want = cli_json(RANKS)
    assert p.returncode == 0, p.stderr
    r = allocsim.fleet.compare(RANKS, progress=False)
    assert r.to_dict() == want
    assert r.exit_code == 0 and r.error is None
    text = cli("compare", RANKS)
    assert str(r) + "\n" == text.stdout
    # The answer itself: rank 1 spikes first, in step 6, and has the largest peak.
    assert [row["file"] for row in r.rows] == RANK_FILES
    assert r.first_spike["file"] == RANK_FILES[1] and r.first_spike["iteration"] == 6
    assert r.largest_peak == RANK_FILES[1]
    # Options reach every file as they reach the command line's.
    p, want = cli_json(*RANK_FILES, "--ranks", "--capacity", "2GiB", "--spike", "1.5")
    r = allocsim.fleet.compare(RANK_FILES, capacity="2GiB", spike=1.5, workers=1, progress=False)
    assert r.to_dict() == want
    assert r.first_oom is not None and r.first_oom["recorded"] is False


def test_ray_engine_gives_the_command_lines_answer(ray):
    p, want = cli_json(RANKS)
    r = allocsim.fleet.compare(RANKS, engine="ray")
    assert r.to_dict() == want
    assert str(r) + "\n" == cli("compare", RANKS).stdout
    # A Ray instance the caller started is left running.
    assert ray.is_initialized()


def check_damaged(r, d):
    p, want = cli_json(d)
    assert p.returncode == 2
    assert r.to_dict() == want
    assert r.exit_code == 2
    assert p.stderr.strip().splitlines()[-1] == f"allocsim: error: {r.error}"
    assert r.error.startswith("2 of 4 files could not be compared")
    rows = {os.path.basename(row["file"]): row for row in r.rows}
    assert rows["rank2.pickle.gz"]["error"] and rows["rank3.pickle"]["error"]
    # The others still answer, with the peaks they have beside the undamaged files.
    whole = {os.path.basename(row["file"]): row for row in allocsim.fleet.compare(RANKS, progress=False).rows}
    for f in ("rank0.pickle.gz", "rank1.pickle.gz"):
        assert rows[f]["error"] is None
        assert rows[f]["iteration_peaks"] == whole[f]["iteration_peaks"]
        assert rows[f]["peak_reserved"] == whole[f]["peak_reserved"] > 0


def test_a_damaged_file_is_an_error_row_and_the_others_answer(damaged):
    check_damaged(allocsim.fleet.compare(damaged, progress=False), damaged)


def test_a_damaged_file_on_ray(ray, damaged):
    check_damaged(allocsim.fleet.compare(damaged, engine="ray"), damaged)


def named_rows(d, prefix, local=None):
    """`compare`'s JSON with each row named by its URL (`prefix` and the file's name; `local`: the
    local directory the command line's rows name, replaced by the prefix) and an error row as
    such (a file read from its bytes may word its error otherwise than one read from its path)."""

    def name(f):
        return prefix + (f[len(local) :].lstrip("/") if local else f)

    for row in d["rows"]:
        row["file"] = name(row["file"])
        row["error"] = bool(row["error"])
    for k in ("first_oom", "first_spike"):
        if d[k]:
            d[k]["file"] = name(d[k]["file"])
    d["largest_peak"] = name(d["largest_peak"])
    return d


@pytest.fixture
def served(damaged):
    """`damaged` served over HTTP on the loopback (Python's http.server, with its directory
    listing): a remote store as fsspec reads it, from this process and from every worker."""
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=damaged)
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield damaged, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def check_served(r, damaged, url):
    p, want = cli_json(damaged)
    assert named_rows(r.to_dict(), "") == named_rows(want, url, local=damaged)
    assert [bool(row["error"]) for row in r.rows] == [False, False, True, True]


def test_http_urls_are_read_through_fsspec(served):
    # A protocol other than file://: fsspec's HTTP filesystem (aiohttp), its directory listing
    # expanded as a directory is, and a glob in the last component.
    need("fsspec")
    need("aiohttp", "fsspec's HTTP filesystem (test_fleet.py, http:// URLs)")
    damaged, url = served
    # (`*` only: in an http:// URL a `?` starts the query.)
    assert allocsim.fleet.expand(url + "rank*.pickle.gz") == [url + n for n in ("rank0.pickle.gz", "rank1.pickle.gz", "rank2.pickle.gz")]
    assert allocsim.fleet.expand(url) == [url + n for n in ("rank0.pickle.gz", "rank1.pickle.gz", "rank2.pickle.gz", "rank3.pickle")]
    check_served(allocsim.fleet.compare(url, progress=False), damaged, url)


def test_http_urls_on_ray(ray, served):
    need("fsspec")
    need("aiohttp", "fsspec's HTTP filesystem (test_fleet.py, http:// URLs)")
    damaged, url = served
    check_served(allocsim.fleet.compare(url, engine="ray"), damaged, url)


def test_urls_are_read_through_fsspec(damaged):
    need("fsspec")
    url = "file://" + damaged
    names = allocsim.fleet.expand(url)
    assert names == [url + "/" + n for n in ("rank0.pickle.gz", "rank1.pickle.gz", "rank2.pickle.gz", "rank3.pickle")]
    r = allocsim.fleet.compare(url, progress=False)
    p, want = cli_json(damaged)
    assert named_rows(r.to_dict(), "") == named_rows(want, "file://")
    assert [bool(row["error"]) for row in r.rows] == [False, False, True, True]
    # A URL that does not exist is an error row too.
    r = allocsim.fleet.compare([url + "/rank0.pickle.gz", url + "/absent.pickle.gz"], progress=False)
    assert r.rows[0]["error"] is None and "absent.pickle.gz" in r.rows[1]["error"]


def test_python_m_allocsim_fleet_prints_what_compare_prints(damaged):
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    run = lambda *a: subprocess.run([sys.executable, "-m", "allocsim.fleet", *a], cwd=ROOT, capture_output=True, text=True, env=env)  # noqa: E731
    p, q = run(RANKS), cli("compare", RANKS)
    assert (p.returncode, p.stdout) == (0, q.stdout), p.stderr
    p, q = run(RANKS, "--json"), cli("compare", RANKS, "--json")
    assert (p.returncode, json.loads(p.stdout)) == (0, json.loads(q.stdout))
    p, q = run(damaged, "--workers", "2"), cli("compare", damaged)
    assert (p.returncode, p.stdout, p.stderr.splitlines()[-1]) == (2, q.stdout, q.stderr.splitlines()[-1])
    p, q = run(RANKS, "--config", "garbage_collection_threshold:2"), cli("compare", RANKS, "--config", "garbage_collection_threshold:2")
    assert (p.returncode, p.stdout, p.stderr) == (2, "", q.stderr)


def test_python_m_allocsim_fleet_on_ray():
    need("ray")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "RAY_ADDRESS")}
    p = subprocess.run([sys.executable, "-m", "allocsim.fleet", RANKS, "--ray", "--json"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == json.loads(cli("compare", RANKS, "--json").stdout)


def test_refusals_before_any_file_is_read():
    with pytest.raises(allocsim.ConfigError):
        allocsim.fleet.compare(RANKS, config="garbage_collection_threshold:2")
    with pytest.raises(ValueError, match="--spike 1"):
        allocsim.fleet.compare(RANKS, spike=1.0)
    with pytest.raises(ValueError, match="engine"):
        allocsim.fleet.compare(RANKS, engine="dask")
    with pytest.raises(ValueError, match="no file matches"):
        allocsim.fleet.compare(RANKS + "/nothing*.pickle")
    with pytest.raises(ValueError, match="no files given"):
        allocsim.fleet.compare([])


def test_progress_over_files(capsys):
    allocsim.fleet.compare(RANK_FILES, workers=1)  # stderr is not a terminal here: no bar
    assert capsys.readouterr().err == ""
    allocsim.fleet.compare(RANK_FILES, workers=1, progress=True)
    assert "2/2" in capsys.readouterr().err


def test_a_summary_is_small_and_crosses_as_json():
    s = allocsim._allocsim.rank_summary(RANK_FILES[1], "rank1")
    d = json.loads(s)
    assert d["row"]["file"] == "rank1" and d["row"]["error"] is None
    assert len(d["iteration_peak_us"]) == len(d["row"]["iteration_peaks"]) >= 12
    assert len(s.encode()) < 2048
    with open(os.path.join(ROOT, RANK_FILES[1]), "rb") as f:
        assert allocsim._allocsim.rank_summary(f.read(), "rank1") == s


def dying_job(tmp_path):
    """A job whose file "crash.pickle.gz" kills the process that reads it: a `sitecustomize` for
    PYTHONPATH makes a process die (os._exit(7)) when it is handed that file, as a worker killed
    by the OOM killer or a segfault would, once ALLOCSIM_TEST_DIE_ON names it. Returns (the job's
    directory, the hook's directory)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('ALLOCSIM_TEST_DIE_ON'):\n"
        "    import allocsim.fleet as f\n"
        "    real = f.summarize\n"
        "    def summarize(name, *a, **k):\n"
        "        if os.path.basename(name) == os.environ['ALLOCSIM_TEST_DIE_ON']:\n"
        "            os._exit(7)\n"
        "        return real(name, *a, **k)\n"
        "    f.summarize = summarize\n"
    )
    job = tmp_path / "job"
    job.mkdir()
    for f in RANK_FILES:
        shutil.copy(os.path.join(ROOT, f), job / os.path.basename(f))
    shutil.copy(os.path.join(ROOT, RANK_FILES[0]), job / "crash.pickle.gz")
    return job, hook


def check_died(rows, error_end):
    """The rows of a job from `dying_job`: the crash file's row is its error, the others answer
    as the command line's `compare` of the two ranks does."""
    rows = {os.path.basename(row["file"]): row for row in rows}
    assert list(rows) == ["crash.pickle.gz", "rank0.pickle.gz", "rank1.pickle.gz"]
    assert rows["crash.pickle.gz"]["error"] is not None and error_end in rows["crash.pickle.gz"]["error"], rows["crash.pickle.gz"]["error"]
    whole = {os.path.basename(row["file"]): row for row in json.loads(cli("compare", RANKS, "--json").stdout)["rows"]}
    for f in ("rank0.pickle.gz", "rank1.pickle.gz"):
        assert rows[f]["error"] is None
        assert rows[f]["peak_reserved"] == whole[f]["peak_reserved"] > 0


def test_a_worker_that_dies_on_a_file_is_that_files_row_and_the_pool_goes_on(tmp_path, monkeypatch):
    # The local pool's workers are `python -m allocsim.fleet._worker` processes.
    job, hook = dying_job(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("ALLOCSIM_TEST_DIE_ON", "crash.pickle.gz")
    # One worker: it dies on the first file (crash sorts first) and a new one reads the rest.
    r = allocsim.fleet.compare(str(job), workers=1, progress=False)
    check_died(r.rows, "the process reading it ended (exit status 7) before it answered")
    assert r.exit_code == 2 and r.error.startswith("1 of 3 files could not be compared")


def test_a_ray_worker_that_dies_on_a_file_is_that_files_row_and_the_others_answer(tmp_path):
    # A Ray worker that dies mid-task (its process ends, as one the OOM killer takes does): Ray
    # reports the task failed (no retries asked), that file's row says so, the other tasks answer.
    # In a process of its own, whose local Ray instance (started by `compare`) and its workers
    # inherit the hook; the module's Ray instance is not touched.
    need("ray")
    job, hook = dying_job(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "RAY_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])
    env["ALLOCSIM_TEST_DIE_ON"] = "crash.pickle.gz"
    script = (
        "import json, sys, allocsim.fleet\n"
        "r = allocsim.fleet.compare(sys.argv[1], engine='ray', task_options={'max_retries': 0}, progress=False)\n"
        "print(json.dumps({'rows': r.rows, 'exit_code': r.exit_code, 'error': r.error}))\n"
    )
    p = subprocess.run([sys.executable, "-c", script, str(job)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.splitlines()[-1])
    check_died(r["rows"], "the Ray task reading it failed")
    assert r["exit_code"] == 2 and r["error"].startswith("1 of 3 files could not be compared")


def test_ray_engine_on_a_two_node_cluster_gives_the_command_lines_answer(damaged):
    # Two Ray nodes (ray.cluster_utils.Cluster: a head and a worker node, each its own raylet
    # with one CPU, on this host), the tasks spread over them (`scheduling_strategy="SPREAD"`),
    # the driver connected by address as to a real cluster. In a process of its own: the
    # module's Ray instance is not touched.
    need("ray")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "RAY_ADDRESS")}
    script = (
        "import json, sys, time, ray, allocsim.fleet\n"
        "from ray.cluster_utils import Cluster\n"
        "c = Cluster(initialize_head=True, head_node_args={'num_cpus': 1, 'include_dashboard': False})\n"
        "c.add_node(num_cpus=1)\n"
        "c.wait_for_nodes()\n"
        "ray.init(address=c.address, log_to_driver=False)\n"
        "nodes = len([n for n in ray.nodes() if n['Alive']])\n"
        "@ray.remote(num_cpus=1)\n"
        "def node(_):\n"
        "    time.sleep(0.5)\n"
        "    return ray.get_runtime_context().get_node_id()\n"
        "used = len(set(ray.get([node.options(scheduling_strategy='SPREAD').remote(i) for i in range(4)])))\n"
        "r = allocsim.fleet.compare(sys.argv[1], engine='ray', task_options={'scheduling_strategy': 'SPREAD'}, progress=False)\n"
        "print(json.dumps({'nodes': nodes, 'used': used, 'answer': r.to_dict(), 'exit_code': r.exit_code}))\n"
        "ray.shutdown()\n"
        "c.shutdown()\n"
    )
    p = subprocess.run([sys.executable, "-c", script, damaged], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.splitlines()[-1])
    assert (r["nodes"], r["used"]) == (2, 2), "the cluster has two nodes and spreads tasks over both"
    q, want = cli_json(damaged)
    assert (r["exit_code"], named_rows(r["answer"], "")) == (2, named_rows(want, ""))
