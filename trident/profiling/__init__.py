"""`deepspeed.profiling`, as `import trident as deepspeed` finds it: the FLOPs profiler
(`trident.monitor.flops_profiler`) under DeepSpeed's module path."""
