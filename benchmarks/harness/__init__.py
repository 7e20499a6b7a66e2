"""What every benchmark study shares: ``launch`` (a fresh process group under a timeout and a memory guard),
``probes`` (memory, load average, page cache, gathered bytes), ``records`` (each rank's JSON report, results files),
``tables`` (markdown cells and ratios) and ``callbacks`` (a step meter for a fit). A study imports these, never
another study."""
