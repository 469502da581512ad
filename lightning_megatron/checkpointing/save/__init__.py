"""Saving: writing a checkpoint and publishing it crash-safely (``saving``), the host buffers the tensors are staged
in (``staging``, ``shared_memory``), the async saves' writer process (``write_process``, ``writer_main``,
``background``) and the save plans kept per structure (``plans``)."""
