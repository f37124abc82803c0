#!/usr/bin/env bash
# Checks the deployment files in deploy/ with whatever tools this machine
# has, and says what it skipped: the systemd unit (systemd-analyze verify),
# the compose file (docker compose config, else a YAML parse) and the image
# (docker build, only with a Docker daemon that answers, and only with
# --build: it compiles the whole server in release). Fails only on a file
# a present tool finds wrong.
#
#   scripts/check_deploy.sh [--build]
set -euo pipefail
cd "$(dirname "$0")/.."

build=""
[ "${1:-}" = "--build" ] && build=yes
failed=0
say() { printf '[deploy] %s\n' "$*"; }

# systemd-analyze verify also checks that ExecStart's binary exists, which it
# does not on a build machine: verify a copy whose ExecStart is /bin/true.
if command -v systemd-analyze >/dev/null; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    sed 's|^ExecStart=.*|ExecStart=/bin/true|' deploy/corolla-server.service >"$tmp/corolla-server.service"
    if out=$(systemd-analyze verify "$tmp/corolla-server.service" 2>&1) && [ -z "$out" ]; then
        say "systemd unit: verified (systemd-analyze verify, ExecStart replaced by /bin/true)"
        exposure=$(systemd-analyze security --offline=true "$tmp/corolla-server.service" 2>/dev/null | grep -o 'Overall exposure level.*' || true)
        [ -z "$exposure" ] || say "systemd unit: $exposure"
    else
        say "systemd unit: systemd-analyze verify complains:"
        printf '%s\n' "$out"
        failed=1
    fi
else
    say "systemd unit: skipped (no systemd-analyze)"
fi

if command -v docker >/dev/null && docker compose version >/dev/null 2>&1; then
    if docker compose -f deploy/compose.yaml config --quiet; then
        say "compose file: valid (docker compose config)"
    else
        failed=1
    fi
elif command -v python3 >/dev/null && python3 -c 'import yaml' 2>/dev/null; then
    if python3 - <<'PY'
import sys, yaml
doc = yaml.safe_load(open("deploy/compose.yaml"))
service = doc["services"]["corolla-server"]
assert service["build"]["dockerfile"] == "deploy/Dockerfile", service["build"]
assert "corolla-state" in doc["volumes"], doc["volumes"]
ports = {p.split(":")[-1] for p in service["ports"]}
for needed in ("31337/tcp", "31337/udp", "31338/tcp", "31338/udp", "8080/tcp"):
    assert needed in ports, f"{needed} is not published"
PY
    then
        say "compose file: parses as YAML and publishes the server's ports (no docker compose here: not validated by Docker)"
    else
        failed=1
    fi
else
    say "compose file: skipped (neither docker compose nor python3 with yaml)"
fi

if ! command -v docker >/dev/null; then
    say "image: skipped (no docker)"
elif ! timeout 10 docker info >/dev/null 2>&1; then
    say "image: skipped (docker is installed but no daemon answers)"
elif [ -z "$build" ]; then
    say "image: skipped (a release build of the server; run with --build)"
elif docker build -f deploy/Dockerfile -t corolla-server:check .; then
    say "image: built (corolla-server:check)"
    docker run --rm corolla-server:check --help >/dev/null && say "image: corolla-server --help runs"
else
    failed=1
fi

exit "$failed"
