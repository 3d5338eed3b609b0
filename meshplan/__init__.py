"""meshplan: plan, simulate and run distributed attention for long-context LLMs.

The pipeline (docs/architecture.md): Topology + Workload -> AttnMatrix -> Plan -> Schedule -> Timeline/Metrics,
and Schedule JSON -> executor -> Measurement -> Comparison. Heavy imports are lazy: importing this
package imports nothing but the standard library.
"""

__version__ = "0.1.0"
