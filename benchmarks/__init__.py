"""Side benchmarks, each run as `python -m benchmarks.NAME`; README.md here holds every measurement."""
