"""Views of what the single controller is doing, for notebooks (ipywidgets) and the panel app.

    from widgets import PlacementExplorer, LiveTimeline, MetricsDashboard, BatchInspector, ClusterView
    from widgets import HeldOut, learning_curves   # did it learn: held-out accuracy, before and after
    from widgets import RunComparison              # several runs overlaid, and how their configs differ
    from widgets import MismatchView               # rollout against trainer log-probs, token by token
    from widgets import ReplayView                 # one batch through several update variants (algo.replay)

Every view computes plain figure data (`view.data()`), shows it as an interactive Bokeh figure
(hover, zoom, click; live views stream new rows into it), as ipywidgets when it is a cell's value
(`view.widget()`) or as a panel layout (`view.panel()`), with a static PNG fallback (`view.png()`)
for saved notebooks. `RunRecorder` writes a run's metrics, trace and last batches as it goes,
for the app.
"""

from widgets.cluster import ClusterView
from widgets.compare import RunComparison
from widgets.dashboard import MetricsDashboard
from widgets.explorer import PlacementExplorer
from widgets.inspector import BatchInspector
from widgets.learning import HeldOut, learning_curves
from widgets.mismatch import MismatchView
from widgets.planning import Estimate, Scenario, estimate
from widgets.recorder import RunRecorder
from widgets.replay import ReplayView
from widgets.timeline import LiveTimeline

__all__ = [
    "BatchInspector",
    "ClusterView",
    "Estimate",
    "HeldOut",
    "LiveTimeline",
    "MetricsDashboard",
    "MismatchView",
    "PlacementExplorer",
    "RunComparison",
    "ReplayView",
    "RunRecorder",
    "Scenario",
    "estimate",
    "learning_curves",
]
