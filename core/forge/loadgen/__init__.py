"""Load generation for forge bench: targets, workloads, arrivals, statistics, the OpenAI load client."""
