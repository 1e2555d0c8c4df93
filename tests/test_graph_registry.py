"""One registry of a runner's compiled graphs (``ascend_spec.graphs``): every graph by name, one warm-up plan run
under one progress bar, one count of failures. The graphs here are the eager backend's (what is planned and run
does not depend on the backend; compiling would only cost CI time)."""
import re

import pytest

from ascend_spec.config import EngineConfig, SpeculativeConfig, GraphModeConfig
from ascend_spec.engine import load_engine
from ascend_spec.graphs import GRAPH_NAMES

GRAPH = GraphModeConfig(backend="eager", graph_batch_sizes=(2, 4))


def _engine(trained_dir, fused: bool):
    return load_engine(trained_dir, EngineConfig(max_model_len=128, max_num_seqs=4, graph=GRAPH, fused_step=fused,
                                                 adaptive_k=False, speculative=SpeculativeConfig(
                                                     num_speculative_tokens=2)))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "stepwise"])
def test_warmup_runs_one_plan_of_every_graph_under_one_bar(trained_dir, capsys, fused):
    """The step graphs, the prompt graph and the draft chain warm in one plan: one bar counts them all (not a bar
    per graph family), and the report names each graph of the plan once."""
    eng = _engine(trained_dir, fused)
    assert set(name for name in GRAPH_NAMES if eng.runner.graphs[name] is not None) == set(GRAPH_NAMES)
    report = eng.warmup(progress=True)
    err = capsys.readouterr().err
    families = sorted({tag.split("_")[0] for tag in report.seconds_by_graph})
    assert families == (["draft", "prefill", "spec"] if fused else ["draft", "prefill", "target"])
    assert report.graphs_compiled == len(report.seconds_by_graph) >= 3
    bars = set(re.findall(r"^\r?([\w ]+): +\d+%", err.replace("\r", "\n"), flags=re.MULTILINE))
    assert bars == {"compiling graphs"}, err
    done = f"{report.graphs_compiled}/{report.graphs_compiled}"
    assert done in err, err


def test_registry_names_each_graph_once(trained_dir):
    eng = _engine(trained_dir, True)
    graphs = eng.runner.graphs
    with pytest.raises(ValueError, match=r"graph name 'draft'; allowed: one of \['fused', 'target', 'prefill', "
                                         r"'draft'\] not yet registered"):
        graphs.add("draft", eng.target_graph)
    with pytest.raises(ValueError, match=r"graph name 'verify'"):
        graphs.add("verify", eng.target_graph)
    assert graphs.failures() == dict.fromkeys(GRAPH_NAMES, 0)
