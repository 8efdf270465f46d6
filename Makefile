# The two set-up commands of README: `make demo` and `make test`. Both install everything they need
# (a small bootstrap venv with tox, then tox's shared environment with forge and its extras).
PYTHON ?= python3
BOOT := .venv-tox
TOX := $(BOOT)/bin/tox

# A runnable Python 3.12 for the serve312 tox env (a pyenv shim that is not selected does not count).
PY312 ?= $(shell for p in $$(command -v python3.12) /usr/bin/python3.12 /usr/local/bin/python3.12 \
	$$HOME/.pyenv/versions/3.12*/bin/python3.12; do [ -x "$$p" ] && "$$p" -c 'import sys' >/dev/null 2>&1 \
	&& { echo "$$p"; break; }; done)

.PHONY: demo test clean

$(TOX):
	$(PYTHON) -m venv $(BOOT)
	$(BOOT)/bin/pip install --quiet --upgrade pip
	$(BOOT)/bin/pip install --quiet "tox>=4.2" "tox-ignore-env-name-mismatch>=0.2.0"

demo: $(TOX)
	$(TOX) -e demo

test: $(TOX)
	@test -n "$(PY312)" || { echo "make test: no runnable python3.12 (the serve312 tox env runs the serving tests under 3.12); install it (apt-get install python3.12, pyenv install 3.12) or set PY312=/path/to/python3.12" >&2; exit 2; }
	@sh scripts/system-packages.sh
	FORGE_PY312=$(PY312) $(TOX) -e core,gpt,llama,clip,minilm,llava,serve312,multirank -- -p no:cacheprovider

clean:
	rm -rf $(BOOT) .tox build *.egg-info
