# The two set-up commands of README: `make demo` and `make test`. Both install everything they need
# (a small bootstrap venv with tox, then tox's shared environment with forge and its extras).
PYTHON ?= python3
BOOT := .venv-tox
TOX := $(BOOT)/bin/tox

.PHONY: demo test clean

$(TOX):
	$(PYTHON) -m venv $(BOOT)
	$(BOOT)/bin/pip install --quiet --upgrade pip
	$(BOOT)/bin/pip install --quiet "tox>=4.2" "tox-ignore-env-name-mismatch>=0.2.0"

demo: $(TOX)
	$(TOX) -e demo

test: $(TOX)
	$(TOX) -e core,gpt,llama,clip,minilm -- -p no:cacheprovider

clean:
	rm -rf $(BOOT) .tox build *.egg-info
