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


def test_report_imports_without_matplotlib_until_it_draws() -> None:
    code = textwrap.dedent(
        """
        import sys

        class NoPlots:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("matplotlib", "torch"):
                    raise ImportError(name + " is blocked in this test")
                return None

        sys.meta_path.insert(0, NoPlots())
        import remat.report
        from remat.ir import synthetic
        from remat.report import module_table, timeline
        g = synthetic.chain(4, batch_size=2, width=8)
        r = remat.solve(g, 10**9, solver="sqrt")
        assert timeline(g, r.plan).plan.peak_bytes == r.peak_bytes
        assert module_table(g, r.plan)
        assert r._repr_html_().startswith("<pre>sqrt (feasible)")  # text without matplotlib
        try:
            remat.report.render_html(g, r)
        except ImportError as exc:
            assert "matplotlib" in str(exc)
        else:
            raise AssertionError("drew without matplotlib")
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
