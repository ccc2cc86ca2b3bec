"""Shared by every test file. The engines the tests build all read the same checkpoint: each (file,
dtype) is read and its tokenizer built once per run, and every engine then gets a fresh dict of the
same tensors (an engine never writes into them). A GGUF file's header is parsed once per run, for us
and for transformers alike. The loaders themselves are tested on fresh files of their own in
test_weights.py and test_tokenizer.py."""

import contextlib
import dataclasses
import functools
import json
import os

import pytest
import torch

import engine
import weights
from config import EngineConfig
from model import ModelConfig
from sequence import Status


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device, skipped without one (.ci/gpu runs -m cuda)")
    config.addinivalue_line("markers", 'slow: over a few seconds on 2 cores; `pytest -m "not slow"` is the inner loop')


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        for item in items:
            if item.get_closest_marker("cuda"):
                item.add_marker(pytest.mark.skip(reason="no CUDA device"))


@pytest.fixture(scope="session", autouse=True)
def read_each_checkpoint_once():
    load = functools.cache(weights.load_weights)

    def load_weights(path: str, dtype: torch.dtype = torch.float32, rank: int = 0, size: int = 1):
        config, state = load(path, dtype, rank, size)
        return config, dict(state)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(weights, "load_weights", load_weights)
        patch.setattr(engine, "load_tokenizer", functools.cache(engine.load_tokenizer))
        try:
            import gguf  # absent on the GPU test machine, which runs on random weights
        except ImportError:
            yield
            return
        reader = weights.gguf_reader()
        parse = functools.cache(lambda path, mtime_ns: reader(path))
        cached = lambda path: parse(os.fspath(path), os.stat(path).st_mtime_ns)  # noqa: E731
        patch.setattr(gguf, "GGUFReader", cached)  # transformers' reader
        patch.setattr(weights, "gguf_reader", lambda: cached)
        # transformers builds this name table once per tensor (a tenth of a second each).
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """torch's thread count is the process's: a test that sets it (bench.py's --torch-threads, an engine's
    torch_threads) must not leave every later test on one thread."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def hf_tokenizer():
    """transformers' tokenizer of the default GGUF: the reference implementation."""
    from transformers import AutoTokenizer

    d, f = os.path.split(weights.resolve_checkpoint())
    return AutoTokenizer.from_pretrained(d, gguf_file=f)


@pytest.fixture(scope="session")
def hf_model():
    """transformers' model on the default GGUF, in float32: the reference implementation."""
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(weights.resolve_checkpoint())
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()


# A two-layer model with SmolLM2's vocabulary, on random weights: for tests of scheduling and serving rather
# than numerics, in milliseconds a step.
TINY = ModelConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


@dataclasses.dataclass
class SeqStep:
    """One sequence in one step: kv_tokens counts all its tokens after the step (prompt and generated), the one
    sampled this step included (its K/V is written next step)."""

    request_id: str
    num_new_tokens: int
    num_generated: int
    kv_tokens: int
    finished: bool


def traced(engine) -> list[list[SeqStep]]:
    """The steps engine runs from now on, one SeqStep per scheduled sequence, recorded through Engine.on_step."""
    steps = []
    engine.on_step = lambda engine, out, outputs, seconds: steps.append(
        [
            SeqStep(s.request_id, n, s.num_tokens - s.num_prompt_tokens, s.num_tokens, s.status is Status.FINISHED)
            for s, n in out.scheduled
        ]
    )
    return steps


@contextlib.contextmanager
def serving(config: EngineConfig, **server_knobs):
    """A server of config on a free loopback port, ready; stopped afterwards."""
    from serve import Server

    s = Server(config, port=0, **server_knobs)
    s.start()
    try:
        assert s.wait_ready(300)
        yield s
    finally:
        s.stop()


@contextlib.contextmanager
def serving_tiny(log_requests: bool = True, **knobs):
    """A server of TINY on random weights (model name "tiny"; the byte tokenizer): for the API's fields and
    failure paths, in milliseconds a request."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(weights.PRESETS, "tiny", TINY)
        with serving(
            EngineConfig(model="tiny", dummy_weights=True, device="cpu", **knobs), log_requests=log_requests
        ) as s:
            yield s


@pytest.fixture(scope="module")
def smollm2_shapes():
    """The preset name of SmolLM2's shapes cut to 2 layers and a vocabulary of 8192, for random weights: the
    real model's matmul and attention kernels at a fraction of the cost."""
    config = ModelConfig(vocab_size=8192, num_hidden_layers=2, tie_word_embeddings=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(weights.PRESETS, "smollm2-shapes", config)
        yield "smollm2-shapes"


@pytest.fixture
def tiny():
    """TINY's preset name, for LLM(model=tiny, dummy_weights=True)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(weights.PRESETS, "tiny", TINY)
        yield "tiny"


@pytest.fixture(scope="session")
def smollm2_4_layers(hf_tokenizer, tmp_path_factory) -> str:
    """A Hugging Face directory holding SmolLM2 cut to its first 4 of 30 layers (embeddings, final norm and
    LM head kept): a real model's numerics at a seventh of the cost, for tests of the scheduler's paths
    (preemption, prefix caching) rather than of the model."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("smollm2-4-layers")
    config, state = weights.load_weights(weights.resolve_checkpoint())
    save_file(
        {k: v.contiguous() for k, v in state.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 4},
        path / "model.safetensors",
    )
    c = config
    with open(path / "config.json", "w") as f:
        json.dump(
            {
                "model_type": "llama",
                "vocab_size": c.vocab_size,
                "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size,
                "num_hidden_layers": 4,
                "num_attention_heads": c.num_attention_heads,
                "num_key_value_heads": c.num_key_value_heads,
                "head_dim": c.head_dim,
                "rms_norm_eps": c.rms_norm_eps,
                "rope_theta": c.rope_theta,
                "max_position_embeddings": c.max_position_embeddings,
                "tie_word_embeddings": c.tie_word_embeddings,
            },
            f,
        )
    hf_tokenizer.save_pretrained(path)
    return str(path)
