# The two commands of the README. Each does its own setup (scripts/setup.sh).
.PHONY: demo test bench lint

demo:
	./scripts/setup.sh
	.venv/bin/tdgather demo

test:
	./scripts/setup.sh test
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python -m pytest

bench:
	./scripts/setup.sh bench
	.venv/bin/python -m benchmarks.suite --quick

lint:
	./scripts/setup.sh dev
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
