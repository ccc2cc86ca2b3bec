from setuptools import setup

setup(
    name="laneserve",
    version="0.1.0",
    description="A minimalist LLM inference engine: continuous batching, paged KV, chunked prefill",
    python_requires=">=3.10",
    py_modules=["model", "weights", "tokenizer", "kv_cache", "scheduler", "engine", "serve", "bench"],
    packages=["attention_cuda"],
    package_data={"attention_cuda": ["*.cu", "*.cpp"]},
    install_requires=["torch>=2.5", "numpy", "tiktoken", "ninja", "gguf", "safetensors", "jinja2"],
    extras_require={"test": ["pytest", "transformers", "accelerate", "openai"]},
)
