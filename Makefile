# The two set-up commands of README: `make demo` and `make test` (and `make docs`, the site into site/). Both install everything they need
# (a small bootstrap venv with tox, then tox's shared environment with forge and its extras).
PYTHON ?= python3
comma := ,
BOOT := .venv-tox
TOX := $(BOOT)/bin/tox

# A runnable Python 3.12 for the serve312 tox env (a pyenv shim that is not selected does not count).
PY312 ?= $(shell for p in $$(command -v python3.12) /usr/bin/python3.12 /usr/local/bin/python3.12 \
	$$HOME/.pyenv/versions/3.12*/bin/python3.12; do [ -x "$$p" ] && "$$p" -c 'import sys' >/dev/null 2>&1 \
	&& { echo "$$p"; break; }; done)

.PHONY: demo test docs clean

ENVS := core,gpt,llama,clip,minilm,llava,serve312,multirank,vllm,docs
NO_PY312 := make test: no runnable python3.12, so the serve312 env (the serving tests under 3.12) is skipped; \
install it (apt-get install python3.12, pyenv install 3.12) or set PY312=/path/to/python3.12

$(TOX):
	$(PYTHON) -m venv $(BOOT)
	$(BOOT)/bin/pip install --quiet --upgrade pip
	$(BOOT)/bin/pip install --quiet "tox>=4.2" "tox-ignore-env-name-mismatch>=0.2.0"

demo: $(TOX)
	$(TOX) -e demo

test: $(TOX)
	@if [ -z "$(PY312)" ] && [ "$$FORGE_REQUIRE_PY312" = 1 ]; then \
		echo "make test: no runnable python3.12 for the serve312 env, and FORGE_REQUIRE_PY312=1 asks for it; install it (apt-get install python3.12, pyenv install 3.12) or set PY312=/path/to/python3.12" >&2; exit 2; fi
	@if [ -z "$(PY312)" ]; then echo "$(NO_PY312)" >&2; fi
	@sh scripts/system-packages.sh
	FORGE_PY312=$(PY312) $(TOX) -e $(if $(PY312),$(ENVS),$(subst serve312$(comma),,$(ENVS))) -- -p no:cacheprovider

docs: $(TOX)
	$(TOX) -e docs
	@echo "make docs: the site is in site/ (open site/index.html)"

clean:
	rm -rf $(BOOT) .tox build site *.egg-info
