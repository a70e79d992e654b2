# Two entry points for a fresh machine: `make demo` (the main job on real text)
# and `make test` (the default test suite). Both create .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEMO   ?= build/demo
PYTEST_ARGS ?=
# pytest-xdist workers for the default suite (the machines here have 2 cores); 0 runs it serially.
PYTEST_WORKERS ?= 2
# Extras installed into .venv (tfds: TensorFlow and TFDS, for the tfds: source and its tests).
EXTRAS ?= train,test,tfds

# Prism, Beam's own runner, for --runner=prism: built from the Go module proxy at the
# version of the Beam SDK that constraints.txt pins (its go.mod needs Go 1.26), into
# build/bin and linked into the venv's bin, where `seqcache build` finds it (docs/scaling.md).
BEAM_VERSION := $(shell sed -n 's/^apache-beam==//p' constraints.txt)
PRISM := build/bin/prism

.PHONY: install prism jars gcp demo test test-slow test-trainers bench clean

# Beam's Flink and Spark job servers (Java), for `seqcache build --runner=flink|spark`:
# Maven fetches Beam's runner libraries and their dependencies from Maven Central
# (runners/*/pom.xml) into $(JARS)/<runner>/. Needs java (17+) and mvn. docs/scaling.md.
JARS ?= build/jars
MVN  ?= mvn
jars: $(JARS)/flink/flink-job-server.jar $(JARS)/spark/spark-job-server.jar

$(JARS)/flink/flink-job-server.jar: runners/flink/pom.xml
$(JARS)/spark/spark-job-server.jar: runners/spark/pom.xml
$(JARS)/flink/flink-job-server.jar $(JARS)/spark/spark-job-server.jar:
	rm -rf $(@D)
	$(MVN) -q -B -f $< package -Dout=$(abspath $(@D))
	rm -rf $(@D)/target

$(VENV)/.deps: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -c constraints.txt '.[$(EXTRAS)]'
	touch $@

# Tests and the demo run against an installed copy of the package (not the source
# tree), so that missing package data or a wrong package-dir shows up here.
install: $(VENV)/.deps
	$(PY) -m pip install -q --no-deps --force-reinstall --no-build-isolation . 2>&1 | grep -v "already satisfied" || true
	rm -rf build/lib build/bdist* *.egg-info

$(PRISM): constraints.txt
	@command -v go >/dev/null || { echo "prism: needs Go 1.26 or newer (go not found)"; exit 1; }
	GOBIN=$(CURDIR)/build/bin GOFLAGS=-modcacherw go install github.com/apache/beam/sdks/v2/go/cmd/prism@v$(BEAM_VERSION)
	touch $@

prism: $(VENV)/.deps $(PRISM)
	ln -sf $(CURDIR)/$(PRISM) $(VENV)/bin/prism

# Beam's Dataflow runner for tests/pipelines/test_dataflow_graph.py (a build's job translated offline):
# the client libraries of Beam's GCP extras and `build`, pinned in runners/dataflow/requirements.txt,
# from PyPI into build/gcp, beside the venv: in it, every process that imports Beam would import them too.
GCP := build/gcp
$(GCP)/.installed: runners/dataflow/requirements.txt $(VENV)/.deps
	rm -rf $(GCP)
	$(PY) -m pip install -q --no-deps --disable-pip-version-check --target $(GCP) -r runners/dataflow/requirements.txt
	touch $@

gcp: $(GCP)/.installed

demo: install
	DEMO=$(DEMO) PATH=$(CURDIR)/$(VENV)/bin:$$PATH bash scripts/demo.sh

# Each test module runs in one worker (its module-scoped fixtures are built once), the
# costliest modules first (tests/conftest.py, HEAVY_FIRST).
test: install prism gcp
	$(VENV)/bin/pytest -q -m "not slow and not heavy" -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

# The costliest tests of the default guarantees (tests/conftest.py, HEAVY), which
# make test leaves out to stay under 5 minutes; CI runs them after it.
test-heavy: install prism gcp
	$(VENV)/bin/pytest -q -m "heavy and not slow" -n $(PYTEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

# The slow tests compile with XLA's default optimization (the default suite's
# tests/conftest.py compiles without LLVM's passes, to halve compile time).
test-slow: install
	XLA_FLAGS="$${XLA_FLAGS:---xla_force_host_platform_device_count=8}" $(VENV)/bin/pytest -q -m slow $(PYTEST_ARGS)

# The real trainers (t5x, levanter, torchtitan, MaxText), each in a venv of its own
# under build/trainers; TRAINERS="levanter torchtitan" picks some. docs/trainers.md.
test-trainers: install
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH bash tests/trainers/run.sh

bench: install
	$(PY) benchmarks/pipeline.py --memory
	$(PY) benchmarks/feeder.py
	$(PY) benchmarks/train.py

clean:
	rm -rf $(VENV) build
