"""Config of the regenerate stage: where the target is served, how it samples, how the output is sharded."""

from typing import Literal

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from dflash_core.schema import StrictModel


class RegenerateConfig(StrictModel):
    """`data.regenerate`: the target re-answers every assistant turn of the chat data before tokenize."""

    enabled: bool = Field(False, description="run the stage in the retrain-drafter flow (the CLI always runs it)")
    endpoints: list[str] = Field(
        default_factory=list,
        description="OpenAI-compatible base URLs (http://10.0.0.5:8000/v1); empty = start a local server")
    serve: Literal["transformers", "vllm", "sglang"] = Field(
        "transformers", description="the local server started for model.target when no endpoint is given")
    serve_args: list[str] = Field(default_factory=list, description="extra command-line flags of that server")
    replicas: PositiveInt = Field(
        1, description="local servers started side by side, the requests spread over them (transformers serve on "
        "CPUs: one per core or two); vLLM and SGLang spread over GPUs themselves (serve_args "
        "--data-parallel-size N / --dp-size N)")
    model: str | None = Field(None, description="model id sent in requests; None = the server's first (/v1/models)")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0,
                                description="nucleus sampling threshold sent with each request; None = not sent (the "
                                "server's default)")
    max_tokens: PositiveInt | None = Field(
        None, description="per reply; longer replies end with finish_reason=length. None = data.max_length: a "
        "longer reply could not be trained whole anyway")
    keep_truncated: bool = Field(False, description="keep replies cut by max_tokens (counted either way)")
    send_tools: bool = Field(
        False, description="send a record's tool definitions with its requests (as `tools`, the server's default "
        "tool choice), so the server renders them as training will: transformers serve takes them; vLLM needs "
        "--enable-auto-tool-choice --tool-call-parser ..., or refuses the request. Off: the definitions are only "
        "written to the output")
    api_key_env: str | None = Field(
        None, description="name of the environment variable holding the endpoints' API key (vLLM/SGLang --api-key), "
        "sent as `Authorization: Bearer`; None = no key, except for a local server: the --api-key of serve_args, or "
        "VLLM_API_KEY from the environment a local vLLM server inherits")
    concurrency: PositiveInt = Field(16, description="requests in flight per endpoint")
    timeout_s: PositiveFloat = Field(600.0, description=(
        "per request, the whole reply (it comes at its end, not streamed): raise it for long replies (reasoning "
        "traces at a large `max_tokens`), which otherwise time out on every retry"))
    retries: NonNegativeInt = Field(
        3, description="retries of a request on 5xx, 408/429, connection errors and bodies "
                       "that do not decode (a proxy's corrupt gzip), with backoff")
    backoff_s: PositiveFloat = Field(1.0, description="first retry delay; doubles every retry")
    startup_timeout_s: PositiveFloat = Field(900.0, description="how long a local server may take to be healthy")
    restart_wait_s: NonNegativeFloat = Field(
        600.0, description="how long the stage waits for the last of the `endpoints` that stopped answering (a "
        "server restarting) to answer GET /models again before it fails; its records wait, none is dropped; 0 = "
        "fail at once (local servers are never waited for: their process is gone)")
    records_per_shard: PositiveInt = Field(
        1000, description="input records per output shard: the unit of resume and of Prefect task runs")
    task_per_shard: bool = Field(
        False, description="flow: one Prefect task run per shard, for a work pool or a Dask/Ray task runner to "
                           "spread over machines (give endpoints: each task run would start its own server)")
    limit: PositiveInt | None = Field(None, description="regenerate only the first N input records")

    def shard_count(self, records: int) -> int:
        """How many shards `records` input records make (the last may hold fewer)."""
        return -(-records // self.records_per_shard)

    @model_validator(mode="after")
    def _replicas_on_cpu(self) -> "RegenerateConfig":
        if self.replicas > 1 and self.serve != "transformers":
            raise ValueError(f"replicas: {self.replicas} would start that many {self.serve} servers on the same "
                             f"GPUs; use the server's own data parallelism in serve_args ("
                             f"{'--data-parallel-size' if self.serve == 'vllm' else '--dp-size'} N) instead")
        return self

    @field_validator("endpoints")
    @classmethod
    def _http(cls, value: list[str]) -> list[str]:
        bad = [u for u in value if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"endpoints must be http(s) base URLs such as http://10.0.0.5:8000/v1; got {bad}")
        urls = [u.rstrip("/") for u in value]
        twice = sorted({u for u in urls if urls.count(u) > 1})
        if twice:  # one server, one set of workers: its refusals and failures are told apart by its URL
            raise ValueError(f"endpoints lists {', '.join(twice)} more than once; list each server once and raise "
                             "concurrency for more requests in flight")
        return urls
