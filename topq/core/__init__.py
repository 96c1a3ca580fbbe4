"""The small core of topq: IR, stage template, plugin system, pipeline, bundle, runtime, CLI."""
