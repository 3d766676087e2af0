# SPDX-License-Identifier: Apache-2.0
"""moecap behind the engines' own capturer interfaces.

``moecap.integrations.sglang``: a class with the interface of SGLang 0.5.23's
``RoutedExpertsCapturer`` and ``install()``, which makes SGLang create it.
``moecap.integrations.vllm``: the same for vLLM 0.33's
``RoutedExpertsCapturer`` (under its aux-output connector).
``moecap.integrations.stream``: reading a running request's routing from a
position onward. docs/ENGINES.md says how to switch an engine over and what
changes for its clients (nothing, byte for byte, while every token has routing).
"""
