"""Model code: layers (`layers/`), the GLM-5.3 model (`models/`), checkpoint loading
(`model_loader`), and the built-in tiny checkpoint (`tiny/`). Math only: no ranks, no schedulers."""
