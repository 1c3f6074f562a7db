# Set-up and the two entry points of README.md: `make demo` and `make test`.
PY ?= python3
APT_PACKAGES := fonts-dejavu-core fonts-noto-core fonts-noto-cjk tesseract-ocr tesseract-ocr-eng redis-server
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: system install install-dev demo test test-fast bench

system:  ## Debian packages: fonts for the renderer, Tesseract for OCR, Redis for the response cache
	@missing=0; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing=1; done; \
	if [ $$missing -eq 1 ]; then \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(APT_PACKAGES) >/dev/null; \
	fi

install: system  ## CPU torch first, so pip never resolves a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .

install-dev: system
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'

demo: install
	qvpic demo

test: install-dev
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: install-dev
	$(PY) -m pytest -q -m "not e2e"

bench: install-dev
	qvpic bench
