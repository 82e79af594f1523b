"""The sign-in page: Django's LoginView, throttled per username and client address (ace.throttle.logins).

Past ACE_LOGIN_THROTTLE failed attempts within ACE_THROTTLE_WINDOW seconds the form answers 429 with the wait,
without checking the password it was sent (a right guess then reads like a wrong one); a success clears the count.
"""

from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.http import HttpResponse

from ace import throttle


class LoginView(auth_views.LoginView):
    def post(self, request, *args, **kwargs) -> HttpResponse:
        self.throttle_key = throttle.login_key(request.POST.get("username", ""), request.META.get("REMOTE_ADDR", ""))
        wait = throttle.logins.wait_s(self.throttle_key)
        if wait:
            context = self.get_context_data(form=self.form_class(request), throttled=throttle.wait_message(wait))
            response = self.render_to_response(context, status=429)
            response["Retry-After"] = str(wait)
            return response
        return super().post(request, *args, **kwargs)

    def form_valid(self, form) -> HttpResponse:
        throttle.logins.succeeded(self.throttle_key)
        return super().form_valid(form)

    def form_invalid(self, form) -> HttpResponse:
        throttle.logins.failed(self.throttle_key)
        return super().form_invalid(form)
