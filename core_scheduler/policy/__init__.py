"""Pure policies over snapshots: no I/O, no clock reads.

``snapshot`` defines the immutable state the policies read; ``routing`` decides per query
(site, variant); ``placement`` decides which variants are loaded where; ``forecast`` predicts
demand so placement can prewarm.

Import from the submodules: this package re-exports nothing, so that an edge agent, which routes but
never places, does not load the placement and forecast policies (issue 17's lean agent).
"""
