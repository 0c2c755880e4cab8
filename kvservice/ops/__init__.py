"""What an operator touches: configuration (file, environment, flags), the command line, counters
and histograms, the Prometheus endpoint, and safe quoting of client strings in logs.
"""
