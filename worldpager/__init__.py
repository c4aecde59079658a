"""WorldPager: tiered KV memory for MG2 world-model sessions. Empty until that issue lands."""
