"""Ray workers hosting models in tiers (see issue: workers). Empty until that issue lands."""
