"""The recipes: the GPT model and corpus, the Kubernetes manifests against the shipped schemas, the Slurm script
checked by bash -n and rendered with stand-ins for srun/scontrol/resilient, and the training recipe under
resilient-run with a killed worker."""
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "recipes" / "kubernetes"
SLURM = ROOT / "recipes" / "slurm" / "train.sbatch"


def _validate(doc, schema, root=None, path="$"):
    """JSON Schema (draft 7), the keywords the shipped schemas use; jsonschema itself is used when installed."""
    root = root or schema
    if "$ref" in schema:
        ref = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            ref = ref[part]
        return _validate(doc, ref, root, path)
    if "oneOf" in schema:
        ok = [s for s in schema["oneOf"] if not _errors(doc, {**s, "definitions": root.get("definitions", {})}, root, path)]
        assert len(ok) == 1, f"{path}: matches {len(ok)} of the oneOf schemas"
    types = {"object": dict, "array": list, "string": str, "integer": int, "boolean": bool}
    if "type" in schema:
        want = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        assert any(isinstance(doc, types[t]) and not (t == "integer" and isinstance(doc, bool)) for t in want), \
            f"{path}: {doc!r} is not {want}"
    if "const" in schema:
        assert doc == schema["const"], f"{path}: {doc!r} != {schema['const']!r}"
    if "enum" in schema:
        assert doc in schema["enum"], f"{path}: {doc!r} not in {schema['enum']}"
    if "pattern" in schema:
        assert re.search(schema["pattern"], doc), f"{path}: {doc!r} does not match {schema['pattern']}"
    if "maxLength" in schema:
        assert len(doc) <= schema["maxLength"], f"{path}: {doc!r} longer than {schema['maxLength']}"
    for k, op in (("minimum", lambda a, b: a >= b), ("maximum", lambda a, b: a <= b)):
        if k in schema:
            assert op(doc, schema[k]), f"{path}: {doc} violates {k} {schema[k]}"
    if isinstance(doc, dict):
        for r in schema.get("required", ()):
            assert r in doc, f"{path}: missing required {r!r}"
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for k, v in doc.items():
            if k in props:
                _validate(v, props[k], root, f"{path}.{k}")
            elif extra is False:
                raise AssertionError(f"{path}: unknown field {k!r}")
            elif isinstance(extra, dict):
                _validate(v, extra, root, f"{path}.{k}")
    if isinstance(doc, list):
        assert len(doc) >= schema.get("minItems", 0), f"{path}: fewer than {schema['minItems']} items"
        for i, v in enumerate(doc):
            if "items" in schema:
                _validate(v, schema["items"], root, f"{path}[{i}]")


def _errors(doc, schema, root, path):
    try:
        _validate(doc, schema, root, path)
        return None
    except AssertionError as e:
        return str(e)


def validate(doc, schema):
    try:
        import jsonschema
    except ImportError:
        _validate(doc, schema)
        return
    jsonschema.validate(doc, schema)


def test_model_and_corpus():
    sys.path.insert(0, str(ROOT / "recipes" / "pytorch"))
    try:
        from model import GPT, GPTConfig, load_corpus
    finally:
        sys.path.pop(0)
    import torch

    tokens = load_corpus()
    assert tokens.dtype == torch.long and tokens.numel() > 200_000 and int(tokens.max()) < 256
    text = bytes(tokens[:2000].tolist()).decode("ascii")
    assert text.count(" the ") > 5  # English prose
    cfg = GPTConfig()
    logits = GPT(cfg)(tokens[: cfg.seq_len].unsqueeze(0))
    assert logits.shape == (1, cfg.seq_len, cfg.vocab_size)
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(d_model=30, n_head=4)
    assert "Python Software Foundation" in (ROOT / "recipes" / "pytorch" / "data" / "README.md").read_text()


def test_kubernetes_manifests_validate_against_the_shipped_schemas():
    jobset_schema = json.loads((K8S / "schemas" / "jobset-v1alpha2.json").read_text())
    k8s_schema = json.loads((K8S / "schemas" / "kubernetes-batch-v1.json").read_text())
    (js,) = list(yaml.safe_load_all((K8S / "jobset.yaml").read_text()))
    validate(js, jobset_schema)
    for doc in yaml.safe_load_all((K8S / "job.yaml").read_text()):
        validate(doc, k8s_schema)
    jobs = {j["name"]: j["template"]["spec"] for j in js["spec"]["replicatedJobs"]}
    sup = jobs["supervisor"]["template"]["spec"]["containers"][0]
    assert sup["command"] == ["resilient", "supervisor"]
    workers = jobs["workers"]
    trainer = workers["template"]["spec"]["containers"][0]
    args = dict(a.split("=", 1) for a in trainer["args"] if a.startswith("--"))
    assert workers["completions"] == int(args["--nnodes"]) + int(args["--spare-nodes"])  # a spare pod
    assert args["--rdzv-endpoint"].startswith("resilient-train-supervisor-0-0.")
    assert args["--ckpt-persistent"].startswith("gs://") and args["--ckpt-local"].startswith("/mnt/localssd")
    vols = {v["name"]: v for v in workers["template"]["spec"]["volumes"]}
    assert "hostPath" in vols["localssd"] and vols["job-secret"]["secret"]["secretName"] == "resilient-train-secret"
    from resilient.launcher.api import INFRASTRUCTURE_EXIT_CODE, PREEMPTED_EXIT_CODE
    from resilient.launcher.exit import SUPERVISOR_UNREACHABLE_EXIT_CODE

    codes = workers["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"]
    assert sorted(codes) == sorted([PREEMPTED_EXIT_CODE, INFRASTRUCTURE_EXIT_CODE, SUPERVISOR_UNREACHABLE_EXIT_CODE])
    # the schema rejects what a typo would produce
    bad = json.loads(json.dumps(js))
    bad["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(Exception, match="volumeMount|Additional properties"):
        validate(bad, jobset_schema)


def _fake_bin(d: Path, name: str, body: str) -> None:
    p = d / name
    p.write_text("#!/bin/bash\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("code,requeued,exit_code", [(0, False, 0), (75, True, 0), (69, True, 0), (76, True, 0),
                                                     (1, False, 1)])
def test_slurm_script_parses_renders_and_requeues_on_preemption_or_infrastructure(tmp_path, code, requeued, exit_code):
    assert subprocess.run(["bash", "-n", str(SLURM)], capture_output=True, timeout=30).returncode == 0
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    calls = tmp_path / "calls"
    # the agents reach the supervisor started in the background: the stand-in waits for it (bounded)
    _fake_bin(bin_, "srun", f'for i in $(seq 200); do grep -q supervisor {calls} 2>/dev/null && break; sleep 0.05; done\n'
                            f'echo "srun $*" >> {calls}\nexit {code}\n')
    _fake_bin(bin_, "scontrol", f'echo "scontrol $*" >> {calls}\n')
    _fake_bin(bin_, "resilient", f'echo "resilient $*" >> {calls}\n'
                                 '[ "$1" = supervisor ] && exec sleep 30\nexit 0\n')
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SLURM_NNODES": "3", "SLURM_JOB_ID": "42",
           "SLURM_JOB_NAME": "gpt", "RES_NPROC": "2", "RES_RUN_DIR": str(tmp_path / "run"), "RES_BUCKET": "gs://b"}
    r = subprocess.run(["bash", str(SLURM)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == exit_code, r.stderr
    log = calls.read_text()
    srun = next(ln for ln in log.splitlines() if ln.startswith("srun "))
    assert "resilient-run --nnodes 2 --nproc-per-node 2 --spare-nodes 1" in srun  # 3 nodes: 2 train, 1 spare
    assert "--ckpt-persistent gs://b/gpt" in srun and "--job-secret-file" in srun
    assert re.search(r"resilient supervisor --rdzv-endpoint \S+:29500 --nnodes 2 --spare-nodes 1", log)
    assert ("scontrol requeue 42" in log) == requeued
    assert len((tmp_path / "run" / "job.secret").read_text()) == 64


@pytest.mark.timeout(180)
def test_gpt_recipe_resumes_after_a_killed_worker(tmp_path):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2",
                        "--max-restarts", "2", "--ckpt-interval", "4", "--run-dir", str(run),
                        "--inject", "kill-worker:1@step9", str(ROOT / "recipes" / "pytorch" / "train.py"),
                        "--steps", "16", "--log-every", "4"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=170)
    assert r.returncode == 0, r.stderr[-3000:]
    starts = re.findall(r"starting at step (\d+) \(epoch 0, sample (\d+)", r.stdout)
    assert len(starts) == 2 and starts[0] == ("0", "0"), r.stdout
    step, sample = map(int, starts[1])
    assert 0 < step <= 9 and sample == step * 16  # the sampler resumed where the restored step left it
    assert "[train] done at step 16" in r.stdout


@pytest.mark.timeout(180)
def test_gpt_recipe_with_a_mesh_that_does_not_fit_stops_the_job_naming_it_not_a_restart_loop(tmp_path):
    # under resilient-run the bad setting is raised, so the supervisor sees the same failure at the same frame in two
    # attempts and stops, naming it, with most of the budget left; plain python: one line, exit 2
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "2",
                        "--max-restarts", "10", "--run-dir", str(tmp_path / "run"),
                        str(ROOT / "recipes" / "pytorch" / "train.py"), "--steps", "4", "--tp", "3"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170)
    assert r.returncode != 0
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    stops = [e for e in events if e["kind"] == "action" and e["details"].get("action") == "stop"]
    assert len(stops) == 1, [e["details"] for e in events if e["kind"] == "action"]
    assert "RecipeInputError" in stops[0]["details"]["reason"] and "--tp 3" in stops[0]["details"]["reason"]
    assert max(e.get("attempt") or 0 for e in events) <= 1  # two attempts, not eleven
    plain = subprocess.run([sys.executable, str(ROOT / "recipes" / "pytorch" / "train.py"), "--steps", "4",
                            "--tp", "3"], cwd=tmp_path, env={**env, "WORLD_SIZE": "1"}, capture_output=True,
                           text=True, timeout=120)
    assert plain.returncode == 2 and "--tp 3 does not divide the world size 1" in plain.stderr, plain.stderr[-2000:]
