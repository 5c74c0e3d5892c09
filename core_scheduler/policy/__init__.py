"""Pure policies over snapshots: no I/O, no clock reads.

``snapshot`` defines the immutable state the policies read; ``routing`` decides per query
(site, variant); ``placement`` decides which variants are loaded where; ``forecast`` predicts
demand so placement can prewarm.
"""

from core_scheduler.policy.forecast import DemandForecaster, EwmaTrend, forecast, update, with_forecast
from core_scheduler.policy.placement import (
    Demand,
    PlacementConfig,
    PlacementEvent,
    PlacementPlan,
    plan_placement,
)
from core_scheduler.policy.routing import REASONS, Decision, Query, RoutingTable
from core_scheduler.policy.routing_candidates import CandidateArrays
from core_scheduler.policy.snapshot import (
    MIB,
    Link,
    MeshSnapshot,
    SiteInfo,
    SiteLoad,
    VariantInfo,
    path_tables,
)

__all__ = [
    "MIB",
    "REASONS",
    "CandidateArrays",
    "Decision",
    "Demand",
    "DemandForecaster",
    "EwmaTrend",
    "Link",
    "MeshSnapshot",
    "PlacementConfig",
    "PlacementEvent",
    "PlacementPlan",
    "Query",
    "RoutingTable",
    "SiteInfo",
    "SiteLoad",
    "VariantInfo",
    "forecast",
    "path_tables",
    "plan_placement",
    "update",
    "with_forecast",
]
