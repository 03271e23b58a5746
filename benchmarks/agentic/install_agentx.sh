#!/usr/bin/env bash
# Install the AgentX harness (agentx-harness on PyPI, command `agentx`) into its own virtual
# environment: its pinned dependencies (huggingface-hub<2, pyzmq 26, psutil 7.0, ...) clash with
# the engine's, so it must not share the engine's venv. CI (.ci/run) and the tests use this script.
#   benchmarks/agentic/install_agentx.sh [VENV]     (default: <repo>/.venv-agentx)
set -euo pipefail
VERSION=1.0.12  # keep in step with AGENTX_VERSION in vllm/benchmarks/agentic/harness.py
VENV="${1:-$(cd "$(dirname "$0")/../.." && pwd)/.venv-agentx}"
if [ -x "$VENV/bin/agentx" ] && [ "$("$VENV/bin/python" -c \
    'import importlib.metadata as m; print(m.version("agentx-harness"))' 2>/dev/null)" = "$VERSION" ]; then
  exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "agentx-harness==$VERSION" 2>&1 | grep -v "is ignored: it is neither" || true
"$VENV/bin/agentx" --version >/dev/null
echo "agentx-harness $VERSION installed in $VENV"
