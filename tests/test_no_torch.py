"""remat.ir, remat.solver and remat.api import without torch (the service runs without it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_core_imports_without_torch() -> None:
    code = textwrap.dedent(
        """
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")
                return None

        sys.meta_path.insert(0, NoTorch())
        import remat
        import remat.ir
        import remat.solver
        import remat.api
        from remat.ir.synthetic import chain
        r = remat.solve(chain(4, batch_size=2, width=8), 10**9, solver="sqrt")
        assert r.status == "feasible", r
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
